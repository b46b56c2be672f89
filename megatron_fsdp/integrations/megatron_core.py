"""Runs Megatron-LM's megatron-core on megatron_fsdp: one call, before megatron-core is imported.

    import megatron_fsdp.integrations.megatron_core as mfsdp_mcore
    mfsdp_mcore.install()
    from megatron.core.distributed import FullyShardedDataParallel  # now on megatron_fsdp

megatron-core ships its own copy of upstream megatron-fsdp under
``megatron.core.distributed.fsdp.src.megatron_fsdp`` and imports it from there (its
``FullyShardedDataParallel`` adapter, the distributed optimizer, the ``fsdp_dtensor`` checkpoint
helpers). :func:`install` puts an import hook first on ``sys.meta_path`` that answers that import
path with megatron_fsdp's modules (the same module objects, not copies):

- the package itself -> :mod:`megatron_fsdp.integrations.mcore_package` (megatron_fsdp's public
  names, with ``MegatronFSDP`` the flavour megatron-core's adapter needs);
- ``.utils``, ``.param_and_grad_buffer``, ``.uneven_dtensor`` -> megatron_fsdp's modules of those
  names (faces over its own modules);
- any other submodule of the bundled copy -> ``ModuleNotFoundError`` naming it.

It also lets two of megatron-core's modules load as they are, then points a few names in them
at megatron_fsdp's: the adapter's mesh helpers at
:mod:`megatron_fsdp.integrations.mcore_adapter_meshes`, which read the meshes from the process
groups (the adapter's own assume no pipeline parallelism), and the fsdp_dtensor checkpoint
helpers' SwiGLU splitter at :mod:`megatron_fsdp.integrations.mcore_gated_fc1` (megatron-core's
own fails at the first save of a ``--swiglu`` model): both through
:mod:`megatron_fsdp.integrations.library_replacements`, which refuses a module whose functions are
not those of the megatron-core version they were written for.

The hook is process-wide: a process runs megatron-core either on megatron_fsdp or on its bundled
copy, not both. docs/megatron_lm.md says what differs and what is refused.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from megatron_fsdp.integrations.library_replacements import (
    MCORE_ADAPTER_MODULE,
    MCORE_REPLACEMENTS,
    Replacement,
    replace_checked,
)
from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

#: Where megatron-core imports its bundled megatron-fsdp from.
UPSTREAM_PACKAGE = "megatron.core.distributed.fsdp.src.megatron_fsdp"
#: Upstream's module name -> the megatron_fsdp module that answers it.
MODULES = {
    UPSTREAM_PACKAGE: "megatron_fsdp.integrations.mcore_package",
    f"{UPSTREAM_PACKAGE}.utils": "megatron_fsdp.utils",
    f"{UPSTREAM_PACKAGE}.param_and_grad_buffer": "megatron_fsdp.param_and_grad_buffer",
    f"{UPSTREAM_PACKAGE}.uneven_dtensor": "megatron_fsdp.uneven_dtensor",
}


class _MegatronFSDPAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the bundled package and its submodules with megatron_fsdp's modules."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in MCORE_REPLACEMENTS:
            return _patched_spec(fullname, path)
        if fullname != UPSTREAM_PACKAGE and not fullname.startswith(UPSTREAM_PACKAGE + "."):
            return None
        if fullname not in MODULES:
            provided = ", ".join(name.rsplit(".", 1)[-1] for name in MODULES if name != UPSTREAM_PACKAGE)
            raise ModuleNotFoundError(
                f"megatron_fsdp.integrations.megatron_core.install() answers {UPSTREAM_PACKAGE} with megatron_fsdp, "
                f"which provides upstream's submodules {provided} (what megatron-core imports), not "
                f"{fullname!r}: import that name from {UPSTREAM_PACKAGE} itself",
                name=fullname,
            )
        # A package, so that its submodules are looked up (here) at all.
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == UPSTREAM_PACKAGE)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # The module object itself: classes keep one identity under both names.
        return importlib.import_module(MODULES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: create_module returned an imported module."""


class _PatchingLoader(importlib.abc.Loader):
    """Loads one of megatron-core's modules with its own loader, then puts megatron_fsdp's
    versions of some of its names in it."""

    def __init__(self, loader: importlib.abc.Loader, replacements: tuple[Replacement, ...]) -> None:
        self.loader, self.replacements = loader, replacements

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        replace_checked(module, self.replacements)


def _patched_spec(fullname: str, path: object) -> importlib.machinery.ModuleSpec | None:
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is not None and spec.loader is not None:
        spec.loader = _PatchingLoader(spec.loader, MCORE_REPLACEMENTS[fullname])
    return spec


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return any(isinstance(finder, _MegatronFSDPAliases) for finder in sys.meta_path)


def install() -> None:
    """Makes megatron-core import megatron_fsdp where it imports its bundled megatron-fsdp.

    Call it once, before anything imports ``megatron.core`` (its ``__init__`` already imports the
    adapter); calling it again is harmless. Raises ``RuntimeError`` when megatron-core has
    already imported its bundled copy (or tried to), since the names it bound then cannot be
    replaced safely.
    """
    if is_installed():
        return
    bundled = sorted(
        name
        for name, module in sys.modules.items()
        if name.startswith(UPSTREAM_PACKAGE) and module is not None and not module.__name__.startswith("megatron_fsdp")
    )
    if bundled or MCORE_ADAPTER_MODULE in sys.modules:  # the adapter binds the bundled names on import
        raise RuntimeError(
            "megatron_fsdp.integrations.megatron_core.install() was called after megatron-core imported its bundled "
            f"megatron-fsdp ({', '.join(bundled) or MCORE_ADAPTER_MODULE}): call install() before the first "
            "`import megatron.core...`, e.g. at the top of the training script"
        )
    sys.meta_path.insert(0, _MegatronFSDPAliases())
    # megatron-core steps torch's optimizers on the faces: step the plain pieces under them.
    install_piece_steps()
