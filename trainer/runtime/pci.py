"""TPU chips on this host's PCI bus, read from sysfs (no torch-tpu, no PJRT).

Google's PCI device ids for TPU chips (vendor 0x1ae0), as in the public jax / cloud-tpu client
sources; v7x's 0x0076 as in torch-tpu 0.2.0's hardware table (docs/metrics.md, docs/tpu.md).
Used by the device layer (is this a TPU host?) and the FLOP/s table (which generation?).
"""

from __future__ import annotations

from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_IDS = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e", "0x0076": "v7x"}


def tpu_generations_on_pci(root: str = "/sys/bus/pci/devices") -> list[str]:
    """The generation of every TPU chip on the PCI bus (one entry per chip), e.g. ["v6e"] * 8."""
    found = []
    for device in sorted(Path(root).glob("*")):
        try:
            if (device / "vendor").read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device_id = (device / "device").read_text().strip()
        except OSError:
            continue
        if device_id in TPU_PCI_IDS:
            found.append(TPU_PCI_IDS[device_id])
    return found
