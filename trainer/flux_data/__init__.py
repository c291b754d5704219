"""The FLUX data set in one room: building it (build.py: the procedural captioned images, their VAE
and text-encoder embeddings, the data set folder and its cache; `scripts/data/build_flux_data.py`
runs it) and reading it (loader.py: the reader of a built folder and the resumable, mesh-independent
loader). It reads the text tokenizer of trainer/data; nothing in trainer/data reads it."""
