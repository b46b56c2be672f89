"""megatron_fsdp replaces another library's code only where it recognises it
(megatron_fsdp/integrations/library_replacements.py): megatron-core's adapter mesh helpers are
replaced when their signatures are 0.19's, and a version whose helper changed is refused with our
error naming the library, the version and what changed, with nothing replaced. megatron-core is
not installed here: stand-in module objects carry the functions, loaded through install()'s own
adapter loader (integrations/megatron_core.py)."""

from __future__ import annotations

import importlib.abc
import types

import pytest

from megatron_fsdp.integrations import mcore_adapter_meshes
from megatron_fsdp.integrations.library_replacements import MCORE_ADAPTER_MESHES, MCORE_ADAPTER_MODULE, replace_checked
from megatron_fsdp.integrations.megatron_core import _PatchingLoader


def _get_dp_tp_mesh(dp_cp_group, tp_group, ep_size=1):
    raise AssertionError("megatron-core's own helper ran")


def _get_hsdp_tp_mesh(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size=1):
    raise AssertionError("megatron-core's own helper ran")


def _newer_get_hsdp_tp_mesh(outer_fsdp_dp_group, dp_cp_group, tp_group):
    """A later megatron-core's helper: no ``ep_size`` (it reads the groups itself)."""


class _StandInLoader(importlib.abc.Loader):
    """Runs as megatron-core's adapter module would: defines the helpers of one version."""

    def __init__(self, hsdp_helper) -> None:
        self.hsdp_helper = hsdp_helper

    def exec_module(self, module: types.ModuleType) -> None:
        module._get_dp_tp_mesh = _get_dp_tp_mesh
        module._get_hsdp_tp_mesh = self.hsdp_helper


def _load_through_install(module: types.ModuleType, hsdp_helper) -> None:
    _PatchingLoader(_StandInLoader(hsdp_helper), MCORE_ADAPTER_MESHES).exec_module(module)


def test_the_adapter_helpers_of_the_version_written_for_are_replaced() -> None:
    module = types.ModuleType(MCORE_ADAPTER_MODULE)
    _load_through_install(module, _get_hsdp_tp_mesh)
    assert module._get_dp_tp_mesh is mcore_adapter_meshes.dp_tp_mesh
    assert module._get_hsdp_tp_mesh is mcore_adapter_meshes.hsdp_tp_mesh


def test_a_helper_that_changed_is_refused_naming_the_version_and_nothing_is_replaced() -> None:
    module = types.ModuleType(MCORE_ADAPTER_MODULE)
    with pytest.raises(RuntimeError) as raised:
        _load_through_install(module, _newer_get_hsdp_tp_mesh)
    assert module._get_dp_tp_mesh is _get_dp_tp_mesh, "a refused replacement replaced part of the module"
    message = str(raised.value)
    for expected in ("_get_hsdp_tp_mesh", "megatron-core 0.19", "(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size=1)",
                     "signature (outer_fsdp_dp_group, dp_cp_group, tp_group)"):
        assert expected in message, message


def test_a_helper_that_is_gone_is_refused() -> None:
    module = types.ModuleType(MCORE_ADAPTER_MODULE)
    module._get_dp_tp_mesh = _get_dp_tp_mesh
    with pytest.raises(RuntimeError, match="has no such function") as raised:
        replace_checked(module, MCORE_ADAPTER_MESHES)
    assert "_get_hsdp_tp_mesh" in str(raised.value)
    assert module._get_dp_tp_mesh is _get_dp_tp_mesh, "a refused replacement replaced part of the module"
