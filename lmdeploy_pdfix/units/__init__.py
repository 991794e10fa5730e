"""One folder per unit, named as its switch (``LMDEPLOY_PDFIX_DISABLE=<folder name>``).

A unit's ``__init__`` holds its ``PATCH`` (a :class:`lmdeploy_pdfix.patching.Patch`); modules beside it hold code
only that unit uses. Its name, target, requirements and summary are declared once, in
:mod:`lmdeploy_pdfix.registry`. Units never import units: what two of them use lives in :mod:`lmdeploy_pdfix.shared`.
"""
