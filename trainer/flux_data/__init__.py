"""FLUX data set building: the procedural captioned images, their VAE and text-encoder embeddings,
the data set folder and its cache (build.py; `scripts/data/build_flux_data.py` runs it). The reader and
loader of a built folder are trainer/data/flux.py."""
