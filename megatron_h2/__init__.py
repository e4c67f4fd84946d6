"""megatron_h2: Megatron-style LLM pretraining across heterogeneous accelerator clusters.

The packages and which may import which: :mod:`megatron_h2.package_graph` (drawn in
``docs/architecture.md``). What users script against: the modules listed under "Public API"
there. Modules that moved stay importable from their old paths
(:mod:`megatron_h2.moved_modules`).
"""

from megatron_h2.moved_modules import install as _install_moved_modules

__version__ = "0.1.0"

_install_moved_modules()


def __getattr__(name: str):
    if name == "LAYERS":  # the former total layer order, derived from the dependency graph
        from megatron_h2.package_graph import layers

        return {pkg: i for i, level in enumerate(layers()) for pkg in level}
    raise AttributeError(f"module 'megatron_h2' has no attribute {name!r}")
