"""Tests of torch's DDP suite that do not apply to gradsync: name (a runtime or a source test name) -> reason.

Only tests whose assertions go through torch internals, that test a feature gradsync refuses by design, or that
assert a behaviour gradsync changes on purpose (README, "What differs from torch on purpose") belong here, each
entered after reading its body. A test of user-visible behaviour that gradsync fails stays out, even when
it also touches a private API further on: it is a bug to fix, not an exemption. Entries leave the regression list
of the report; their outcomes are still run and recorded.
"""

from __future__ import annotations

_LOGGING = "asserts only on torch's private DDP logging data (_get_ddp_logging_data)"
_BUFFER_HOOK = "tests torch-private _register_buffer_comm_hook / _BufferCommHookLocation"
_ERROR_EARLIER = (
    "differs on purpose: expects the unused-parameter error at the next iteration's forward, inside its try block; "
    "gradsync raises at the end of the backward that left the parameters unreduced, one iteration earlier (so no "
    "optimizer step applies half-averaged gradients), quoting torch's phrases"
)
_PARAM_NAME_MAPPING = "tests torch-private _build_params_for_reducer / _build_debug_param_to_name_mapping"

NOT_APPLICABLE: dict[str, str] = {
    # torch-private DDP logging (C++ Logger)
    "test_ddp_logging_data_cpu": _LOGGING + " and _set_ddp_runtime_logging_sample_rate",
    "test_ddp_logging_data_gpu": _LOGGING + " and _set_ddp_runtime_logging_sample_rate",
    "test_ddp_comm_hook_logging": _LOGGING + "['comm_hook'] after register_comm_hook",
    "test_sync_bn_logged": _LOGGING + "['has_sync_bn']",
    "test_ddp_python_error_logged": "tests that an error is recorded in _get_ddp_logging_data (verify_ddp_error_logged)"
    "; its user-visible part (register_comm_hook({}, {}) raises TypeError) passes with gradsync",
    "test_different_graph_across_ranks": _LOGGING + "['has_rebuilt_buckets'] (bucket rebuild is internal)",
    "test_skip_all_reduce_unused_parameters": _LOGGING + "['num_buckets_reduced']: the only observable of "
    "skip_all_reduce_unused_params it checks, before comparing parameters",
    # torch-private DDP / Reducer methods
    "test_ddp_broadcast_buffer_via_hook": _BUFFER_HOOK + " (with _default_broadcast_coalesced)",
    "test_ddp_buffer_hook_allreduce": _BUFFER_HOOK,
    "test_ddp_buffer_hook_allreduce_return_future": _BUFFER_HOOK,
    "test_ddp_build_debug_param_to_name_mapping": _PARAM_NAME_MAPPING,
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": _PARAM_NAME_MAPPING,
    "test_detect_ddp_is_actually_static": "asserts only on the C++ Reducer's private _ddp_graph_static()",
    "test_ddp_remove_autograd_hooks": "tests torch-private _remove_autograd_hooks() (for torch.compile's DDP)",
    "test_ddp_sink_noclone": "tests torch-private _set_ddp_sink_clone(False) (_DDPSink's clone switch)",
    "test_get_data_parallel_params": "tests torch-private static DistributedDataParallel._get_data_parallel_params",
    "test_static_graph_api_cpu": "tests the error of torch-private _set_static_graph() called late, and its logging "
    "(static_graph=True is the public API)",
    "test_ddp_sync_module_states": "tests torch-private torch.distributed.utils._sync_module_states, fed with torch "
    "DDP's attributes broadcast_bucket_size and parameters_to_ignore",
    "test_ddp_control_flow_same_across_ranks": "asserts on the C++ Reducer's private _get_local_used_map() each "
    "step, then on the unused-parameter error at torch's iteration through verify_ddp_error_logged "
    "(_get_ddp_logging_data); " + _ERROR_EARLIER,
    "test_ddp_control_flow_different_across_ranks": "asserts on the C++ Reducer's private _get_local_used_map() each "
    "step, then on the error at torch's iteration through verify_ddp_error_logged (_get_ddp_logging_data); "
    + _ERROR_EARLIER,
    "test_invalid_static_graph": "after each error asserts through verify_ddp_error_logged (_get_ddp_logging_data); "
    "its first error's words match ('Your training graph has changed in this iteration'); the second expects "
    "torch's whole message verbatim at torch's iteration: gradsync raises at the end of that backward with torch's "
    "phrases in its own message",
    # behaviour gradsync changes on purpose
    "test_ddp_multiple_nested_unused_params_error": _ERROR_EARLIER,
    "test_ddp_multiple_nested_unused_params_err_ignore_params": _ERROR_EARLIER,
    "test_ddp_unused_params_rebuild_buckets_exception": _ERROR_EARLIER + "; also reads verify_ddp_error_logged",
}
