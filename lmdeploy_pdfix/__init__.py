"""lmdeploy-pdfix: control-plane fixes for LMDeploy's Prefill/Decode-disaggregated (DistServe) serving.

Switched on for every Python process by ``LMDEPLOY_PDFIX=1`` (see the start-up hook
``lmdeploy_pdfix.pth``); ``install()`` does the same by hand, e.g. under ``python -S`` or when embedding.
Standard library only at import time.
"""

from __future__ import annotations

__version__ = '0.1.0'


def install() -> None:
    """Register the patches: each applies as soon as its LMDeploy module is (or already was) imported."""
    from lmdeploy_pdfix._bootstrap import install_patches

    install_patches()


__all__ = ['__version__', 'install']
