"""The operator's tools: ``lmdeploy-pdfix status`` and ``doctor``."""
