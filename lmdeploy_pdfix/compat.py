"""The LMDeploy releases this package supports: declared once, read by packaging and by the runtime guard."""

from __future__ import annotations

LMDEPLOY_REQUIREMENT = 'lmdeploy>=0.17.0,<0.19'


def lmdeploy_version() -> str | None:
    """The imported LMDeploy's version, or None where it cannot be read."""
    try:
        from lmdeploy import version
    except ImportError:
        return None
    return getattr(version, '__version__', None)


def unsupported_version_reason(version: str | None) -> str | None:
    """Why ``version`` is outside the supported range, or None when it is inside."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    specifier = Requirement(LMDEPLOY_REQUIREMENT).specifier
    if version is None:
        return 'cannot read lmdeploy.version.__version__'
    try:
        supported = specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return f'LMDeploy version {version!r} is not a valid version'
    if supported:
        return None
    return f'LMDeploy {version} is outside the supported range {specifier}'
