"""One module per patched LMDeploy area; each exposes ``PATCH``, a :class:`lmdeploy_pdfix.patching.Patch`."""
