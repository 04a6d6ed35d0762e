"""SGLang's ServerArgs names that specserve has no field for, and what it does with each.

A script written for `sglang.Engine(...)` or a `sglang.launch_server` command line passes
such names; refusing them breaks the script for nothing when they only tune something
specserve does its own way. So every name in SGLang's ServerArgs (release 0.5.6) is known:

- a name in `TUNING` is accepted, with one warning when its value differs from SGLang's
  default (the reason says what specserve does instead);
- any other name is a feature specserve does not have (LoRA, quantization, parallelism,
  multimodal, ...): accepted at SGLang's default value, a `NotSupportedError` otherwise.

The names that specserve implements are ServerArgs fields (args.py), not listed here.
"""
from __future__ import annotations

import logging
from typing import Any

from specserve.errors import NotSupportedError

logger = logging.getLogger("specserve")

# name -> (SGLang's default, value kind: b bool flag, i int, f float, s str, l list)
SGLANG_ONLY_FIELDS: dict[str, tuple[Any, str]] = {
    "tokenizer_mode": ('auto', "s"),
    "tokenizer_worker_num": (1, "i"),
    "skip_tokenizer_init": (False, "b"),
    "model_loader_extra_config": ('{}', "s"),
    "trust_remote_code": (False, "b"),
    "is_embedding": (False, "b"),
    "enable_multimodal": (None, "b"),
    "revision": (None, "s"),
    "model_impl": ('auto', "s"),
    "fastapi_root_path": ('', "s"),
    "grpc_mode": (False, "b"),
    "warmups": (None, "s"),
    "nccl_port": (None, "i"),
    "checkpoint_engine_wait_weights_before_ready": (False, "b"),
    "quantization": (None, "s"),
    "quantization_param_path": (None, "s"),
    "kv_cache_dtype": ('auto', "s"),
    "enable_fp32_lm_head": (False, "b"),
    "modelopt_quant": (None, "s"),
    "modelopt_checkpoint_restore_path": (None, "s"),
    "modelopt_checkpoint_save_path": (None, "s"),
    "modelopt_export_path": (None, "s"),
    "quantize_and_serve": (False, "b"),
    "max_queued_requests": (None, "i"),
    "max_prefill_tokens": (16384, "i"),
    "enable_priority_scheduling": (False, "b"),
    "abort_on_priority_when_disabled": (False, "b"),
    "schedule_low_priority_values_first": (False, "b"),
    "priority_scheduling_preemption_threshold": (10, "i"),
    "schedule_conservativeness": (1.0, "f"),
    "page_size": (None, "i"),
    "hybrid_kvcache_ratio": (None, "f"),
    "swa_full_tokens_ratio": (0.8, "f"),
    "disable_hybrid_swa_memory": (False, "b"),
    "radix_eviction_policy": ('lru', "s"),
    "pp_size": (1, "i"),
    "pp_max_micro_batch_size": (None, "i"),
    "stream_interval": (1, "i"),
    "stream_output": (False, "b"),
    "constrained_json_whitespace_pattern": (None, "s"),
    "constrained_json_disable_any_whitespace": (False, "b"),
    "watchdog_timeout": (300, "f"),
    "dist_timeout": (None, "i"),
    "download_dir": (None, "s"),
    "base_gpu_id": (0, "i"),
    "gpu_id_step": (1, "i"),
    "sleep_on_idle": (False, "b"),
    "mm_process_config": (None, "s"),
    "log_level_http": (None, "s"),
    "log_requests": (False, "b"),
    "log_requests_level": (2, "i"),
    "crash_dump_folder": (None, "s"),
    "show_time_cost": (False, "b"),
    "enable_metrics": (False, "b"),
    "enable_metrics_for_all_schedulers": (False, "b"),
    "tokenizer_metrics_custom_labels_header": ('x-custom-labels', "s"),
    "tokenizer_metrics_allowed_custom_labels": (None, "l"),
    "bucket_time_to_first_token": (None, "l"),
    "bucket_inter_token_latency": (None, "l"),
    "bucket_e2e_request_latency": (None, "l"),
    "collect_tokens_histogram": (False, "b"),
    "prompt_tokens_buckets": (None, "l"),
    "generation_tokens_buckets": (None, "l"),
    "gc_warning_threshold_secs": (0.0, "f"),
    "decode_log_interval": (40, "i"),
    "enable_request_time_stats_logging": (False, "b"),
    "kv_events_config": (None, "s"),
    "enable_trace": (False, "b"),
    "otlp_traces_endpoint": ('localhost:4317', "s"),
    "export_metrics_to_file": (False, "b"),
    "export_metrics_to_file_dir": (None, "s"),
    "weight_version": ('default', "s"),
    "chat_template": (None, "s"),
    "completion_template": (None, "s"),
    "file_storage_path": ('sglang_storage', "s"),
    "enable_cache_report": (False, "b"),
    "reasoning_parser": (None, "s"),
    "tool_call_parser": (None, "s"),
    "tool_server": (None, "s"),
    "sampling_defaults": ('model', "s"),
    "dp_size": (1, "i"),
    "load_balance_method": ('round_robin', "s"),
    "load_watch_interval": (0.1, "f"),
    "prefill_round_robin_balance": (False, "b"),
    "dist_init_addr": (None, "s"),
    "nnodes": (1, "i"),
    "node_rank": (0, "i"),
    "json_model_override_args": ('{}', "s"),
    "preferred_sampling_params": (None, "s"),
    "enable_lora": (None, "b"),
    "max_lora_rank": (None, "i"),
    "lora_target_modules": (None, "s"),
    "lora_paths": (None, "s"),
    "max_loaded_loras": (None, "i"),
    "max_loras_per_batch": (8, "i"),
    "lora_eviction_policy": ('lru', "s"),
    "lora_backend": ('csgmv', "s"),
    "max_lora_chunk_size": (16, "i"),
    "sampling_backend": (None, "s"),
    "grammar_backend": (None, "s"),
    "mm_attention_backend": (None, "s"),
    "nsa_prefill_backend": ('flashmla_sparse', "s"),
    "nsa_decode_backend": ('fa3', "s"),
    "enable_flashinfer_autotune": (False, "b"),
    "speculative_draft_model_revision": (None, "s"),
    "speculative_draft_load_format": (None, "s"),
    "speculative_accept_threshold_single": (1.0, "f"),
    "speculative_accept_threshold_acc": (1.0, "f"),
    "speculative_attention_mode": ('prefill', "s"),
    "speculative_moe_runner_backend": (None, "s"),
    "ep_size": (1, "i"),
    "moe_a2a_backend": ('none', "s"),
    "moe_runner_backend": ('auto', "s"),
    "flashinfer_mxfp4_moe_precision": ('default', "s"),
    "enable_flashinfer_allreduce_fusion": (False, "b"),
    "deepep_mode": ('auto', "s"),
    "ep_num_redundant_experts": (0, "i"),
    "ep_dispatch_algorithm": (None, "s"),
    "init_expert_location": ('trivial', "s"),
    "enable_eplb": (False, "b"),
    "eplb_algorithm": ('auto', "s"),
    "eplb_rebalance_num_iterations": (1000, "i"),
    "eplb_rebalance_layers_per_chunk": (None, "i"),
    "eplb_min_rebalancing_utilization_threshold": (1.0, "f"),
    "expert_distribution_recorder_mode": (None, "s"),
    "expert_distribution_recorder_buffer_size": (None, "i"),
    "enable_expert_distribution_metrics": (False, "b"),
    "deepep_config": (None, "s"),
    "moe_dense_tp_size": (None, "i"),
    "elastic_ep_backend": (None, "s"),
    "mooncake_ib_device": (None, "s"),
    "max_mamba_cache_size": (None, "i"),
    "mamba_ssm_dtype": ('float32', "s"),
    "mamba_full_memory_ratio": (0.9, "f"),
    "enable_hierarchical_cache": (False, "b"),
    "hicache_ratio": (2.0, "f"),
    "hicache_size": (0, "i"),
    "hicache_write_policy": ('write_through', "s"),
    "hicache_io_backend": ('kernel', "s"),
    "hicache_mem_layout": ('layer_first', "s"),
    "hicache_storage_backend": (None, "s"),
    "hicache_storage_prefetch_policy": ('best_effort', "s"),
    "hicache_storage_backend_extra_config": (None, "s"),
    "enable_lmcache": (False, "b"),
    "kt_weight_path": (None, "s"),
    "kt_method": (None, "s"),
    "kt_cpuinfer": (None, "i"),
    "kt_threadpool_count": (None, "i"),
    "kt_num_gpu_experts": (None, "i"),
    "kt_max_deferred_experts_per_token": (None, "i"),
    "dllm_algorithm": (None, "s"),
    "dllm_block_size": (None, "i"),
    "enable_double_sparsity": (False, "b"),
    "ds_channel_config_path": (None, "s"),
    "ds_heavy_channel_num": (32, "i"),
    "ds_heavy_token_num": (256, "i"),
    "ds_heavy_channel_type": ('qk', "s"),
    "ds_sparse_decode_threshold": (4096, "i"),
    "cpu_offload_gb": (0, "i"),
    "offload_group_size": (-1, "i"),
    "offload_num_in_group": (1, "i"),
    "offload_prefetch_step": (1, "i"),
    "offload_mode": ('cpu', "s"),
    "multi_item_scoring_delimiter": (None, "s"),
    "cuda_graph_bs": (None, "l"),
    "disable_cuda_graph_padding": (False, "b"),
    "enable_profile_cuda_graph": (False, "b"),
    "enable_cudagraph_gc": (False, "b"),
    "enable_layerwise_nvtx_marker": (False, "b"),
    "enable_nccl_nvls": (False, "b"),
    "enable_symm_mem": (False, "b"),
    "disable_flashinfer_cutlass_moe_fp4_allgather": (False, "b"),
    "enable_tokenizer_batch_encode": (False, "b"),
    "disable_tokenizer_batch_decode": (False, "b"),
    "disable_outlines_disk_cache": (False, "b"),
    "disable_custom_all_reduce": (False, "b"),
    "enable_mscclpp": (False, "b"),
    "enable_torch_symm_mem": (False, "b"),
    "enable_dp_attention": (False, "b"),
    "enable_dp_lm_head": (False, "b"),
    "enable_two_batch_overlap": (False, "b"),
    "enable_single_batch_overlap": (False, "b"),
    "tbo_token_distribution_threshold": (0.48, "f"),
    "enable_torch_compile": (False, "b"),
    "enable_piecewise_cuda_graph": (False, "b"),
    "enable_torch_compile_debug_mode": (False, "b"),
    "torch_compile_max_bs": (32, "i"),
    "piecewise_cuda_graph_max_tokens": (4096, "i"),
    "piecewise_cuda_graph_tokens": (None, "l"),
    "piecewise_cuda_graph_compiler": ('eager', "s"),
    "torchao_config": ('', "s"),
    "enable_nan_detection": (False, "b"),
    "enable_p2p_check": (False, "b"),
    "triton_attention_reduce_in_fp32": (False, "b"),
    "triton_attention_num_kv_splits": (8, "i"),
    "triton_attention_split_tile_size": (None, "i"),
    "num_continuous_decode_steps": (1, "i"),
    "delete_ckpt_after_loading": (False, "b"),
    "enable_memory_saver": (False, "b"),
    "enable_weights_cpu_backup": (False, "b"),
    "enable_draft_weights_cpu_backup": (False, "b"),
    "allow_auto_truncate": (False, "b"),
    "enable_custom_logit_processor": (False, "b"),
    "flashinfer_mla_disable_ragged": (False, "b"),
    "disable_shared_experts_fusion": (False, "b"),
    "disable_chunked_prefix_cache": (False, "b"),
    "disable_fast_image_processor": (False, "b"),
    "keep_mm_feature_on_device": (False, "b"),
    "enable_return_hidden_states": (False, "b"),
    "scheduler_recv_interval": (1, "i"),
    "numa_node": (None, "l"),
    "enable_deterministic_inference": (False, "b"),
    "rl_on_policy_target": (None, "s"),
    "enable_attn_tp_input_scattered": (False, "b"),
    "enable_nsa_prefill_context_parallel": (False, "b"),
    "enable_dynamic_batch_tokenizer": (False, "b"),
    "dynamic_batch_tokenizer_batch_size": (32, "i"),
    "dynamic_batch_tokenizer_batch_timeout": (0.002, "f"),
    "debug_tensor_dump_output_folder": (None, "s"),
    "debug_tensor_dump_layers": (None, "l"),
    "debug_tensor_dump_input_file": (None, "s"),
    "debug_tensor_dump_inject": (False, "b"),
    "disaggregation_mode": ('null', "s"),
    "disaggregation_transfer_backend": ('mooncake', "s"),
    "disaggregation_bootstrap_port": (8998, "i"),
    "disaggregation_decode_tp": (None, "i"),
    "disaggregation_decode_dp": (None, "i"),
    "disaggregation_prefill_pp": (1, "i"),
    "disaggregation_ib_device": (None, "s"),
    "disaggregation_decode_enable_offload_kvcache": (False, "b"),
    "num_reserved_decode_tokens": (512, "i"),
    "disaggregation_decode_polling_interval": (1, "i"),
    "custom_weight_loader": (None, "l"),
    "weight_loader_disable_mmap": (False, "b"),
    "remote_instance_weight_loader_seed_instance_ip": (None, "s"),
    "remote_instance_weight_loader_seed_instance_service_port": (None, "i"),
    "remote_instance_weight_loader_send_weights_group_ports": (None, "l"),
    "enable_pdmux": (False, "b"),
    "pdmux_config_path": (None, "s"),
    "sm_group_num": (8, "i"),
    "mm_max_concurrent_calls": (32, "i"),
    "mm_per_request_timeout": (10.0, "f"),
    "enable_broadcast_mm_inputs_process": (False, "b"),
    "decrypted_config_file": (None, "s"),
    "decrypted_draft_config_file": (None, "s"),
    "mm_enable_dp_encoder": (False, "b"),
    "forward_hooks": (None, "l"),
}

_NO_PREFIX_CACHE = "specserve's prefix cache is one radix tree in device memory, evicted least recently used first"
_ONE_DEVICE = "specserve runs on one device, without NCCL"
_NO_MOE = "specserve serves dense models (Llama, Qwen2, Qwen3), no mixture-of-experts"
_NO_MAMBA = "specserve serves no state-space models"
_NO_MULTIMODAL = "specserve serves text-only models"
_OBSERVABILITY = "specserve logs throughput every --log-interval-s and serves /metrics; no other telemetry"
_GRAPHS = "specserve captures its own CUDA graphs per batch bucket up to --cuda-graph-max-bs"
_KERNELS = "specserve picks its kernels with --attention-backend"
_SCHEDULER = "specserve's scheduler is FCFS with chunked prefill (--chunked-prefill-size)"
_LOADER = "specserve detects the format from the path (GGUF file or HF directory) and loads it whole"
_TOKENIZER = "specserve tokenizes in the engine process with the model's own tokenizer"

# Accepted with one warning when set: options that only tune how SGLang does something
# that specserve does differently (or does not need), never what a request returns.
TUNING: dict[str, str] = {
    **dict.fromkeys(("tokenizer_mode", "tokenizer_worker_num", "enable_tokenizer_batch_encode",
                     "disable_tokenizer_batch_decode", "enable_dynamic_batch_tokenizer",
                     "dynamic_batch_tokenizer_batch_size", "dynamic_batch_tokenizer_batch_timeout"), _TOKENIZER),
    **dict.fromkeys(("model_loader_extra_config", "model_impl", "weight_loader_disable_mmap",
                     "delete_ckpt_after_loading", "trust_remote_code"), _LOADER),
    **dict.fromkeys(("radix_eviction_policy", "enable_hierarchical_cache", "hicache_ratio",
                     "hicache_size", "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout",
                     "hicache_storage_backend", "hicache_storage_prefetch_policy",
                     "hicache_storage_backend_extra_config", "enable_lmcache", "disable_chunked_prefix_cache",
                     "enable_cache_report"), _NO_PREFIX_CACHE),
    **dict.fromkeys(("nccl_port", "dist_timeout", "gpu_id_step", "enable_nccl_nvls", "enable_symm_mem",
                     "disable_custom_all_reduce", "enable_mscclpp", "enable_torch_symm_mem", "enable_p2p_check",
                     "enable_dp_attention", "enable_dp_lm_head", "load_balance_method", "load_watch_interval",
                     "prefill_round_robin_balance", "pp_max_micro_batch_size", "enable_attn_tp_input_scattered",
                     "enable_nsa_prefill_context_parallel", "numa_node"), _ONE_DEVICE),
    **dict.fromkeys(("moe_a2a_backend", "moe_runner_backend", "flashinfer_mxfp4_moe_precision",
                     "enable_flashinfer_allreduce_fusion", "deepep_mode", "ep_num_redundant_experts",
                     "ep_dispatch_algorithm", "init_expert_location", "enable_eplb", "eplb_algorithm",
                     "eplb_rebalance_num_iterations", "eplb_rebalance_layers_per_chunk",
                     "eplb_min_rebalancing_utilization_threshold", "expert_distribution_recorder_mode",
                     "expert_distribution_recorder_buffer_size", "enable_expert_distribution_metrics",
                     "deepep_config", "moe_dense_tp_size", "elastic_ep_backend", "mooncake_ib_device",
                     "speculative_moe_runner_backend", "disable_shared_experts_fusion",
                     "disable_flashinfer_cutlass_moe_fp4_allgather", "kt_weight_path", "kt_method", "kt_cpuinfer",
                     "kt_threadpool_count", "kt_num_gpu_experts", "kt_max_deferred_experts_per_token"), _NO_MOE),
    **dict.fromkeys(("max_mamba_cache_size", "mamba_ssm_dtype", "mamba_full_memory_ratio"), _NO_MAMBA),
    **dict.fromkeys(("mm_process_config", "mm_attention_backend", "disable_fast_image_processor",
                     "keep_mm_feature_on_device", "mm_max_concurrent_calls", "mm_per_request_timeout",
                     "enable_broadcast_mm_inputs_process", "mm_enable_dp_encoder"), _NO_MULTIMODAL),
    **dict.fromkeys(("log_level_http", "log_requests", "log_requests_level", "crash_dump_folder", "show_time_cost",
                     "enable_metrics", "enable_metrics_for_all_schedulers", "tokenizer_metrics_custom_labels_header",
                     "tokenizer_metrics_allowed_custom_labels", "bucket_time_to_first_token",
                     "bucket_inter_token_latency", "bucket_e2e_request_latency", "collect_tokens_histogram",
                     "prompt_tokens_buckets", "generation_tokens_buckets", "gc_warning_threshold_secs",
                     "decode_log_interval", "enable_request_time_stats_logging", "kv_events_config", "enable_trace",
                     "otlp_traces_endpoint", "export_metrics_to_file", "export_metrics_to_file_dir",
                     "enable_profile_cuda_graph", "enable_layerwise_nvtx_marker", "enable_nan_detection",
                     "debug_tensor_dump_output_folder", "debug_tensor_dump_layers", "debug_tensor_dump_input_file",
                     "debug_tensor_dump_inject", "weight_version"), _OBSERVABILITY),
    **dict.fromkeys(("cuda_graph_bs", "disable_cuda_graph_padding", "enable_cudagraph_gc", "enable_torch_compile",
                     "enable_piecewise_cuda_graph", "enable_torch_compile_debug_mode", "torch_compile_max_bs",
                     "piecewise_cuda_graph_max_tokens", "piecewise_cuda_graph_tokens",
                     "piecewise_cuda_graph_compiler"), _GRAPHS),
    **dict.fromkeys(("sampling_backend", "nsa_prefill_backend",
                     "nsa_decode_backend", "enable_flashinfer_autotune", "triton_attention_reduce_in_fp32",
                     "triton_attention_num_kv_splits", "triton_attention_split_tile_size",
                     "flashinfer_mla_disable_ragged", "speculative_attention_mode", "ds_channel_config_path",
                     "ds_heavy_channel_num", "ds_heavy_token_num", "ds_heavy_channel_type", "ds_sparse_decode_threshold",
                     "hybrid_kvcache_ratio", "swa_full_tokens_ratio", "disable_hybrid_swa_memory"), _KERNELS),
    **dict.fromkeys(("max_prefill_tokens", "schedule_conservativeness",
                     "enable_two_batch_overlap", "enable_single_batch_overlap", "tbo_token_distribution_threshold",
                     "num_continuous_decode_steps", "scheduler_recv_interval", "sleep_on_idle", "stream_interval",
                     "watchdog_timeout", "warmups", "num_reserved_decode_tokens", "enable_pdmux", "sm_group_num",
                     "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
                     "disaggregation_decode_tp", "disaggregation_decode_dp", "disaggregation_prefill_pp",
                     "disaggregation_ib_device", "disaggregation_decode_enable_offload_kvcache",
                     "disaggregation_decode_polling_interval"), _SCHEDULER),
    **dict.fromkeys(("enable_memory_saver", "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup",
                     "cpu_offload_gb", "offload_group_size", "offload_num_in_group", "offload_prefetch_step",
                     "offload_mode", "file_storage_path", "grammar_backend", "disable_outlines_disk_cache",
                     "constrained_json_whitespace_pattern", "constrained_json_disable_any_whitespace"),
                    "specserve keeps every weight and the whole KV cache on the device and has no constrained decoding"),
    "page_size": "specserve's KV cache is token-granular (pages of one token)",
}
# SGLang's aliases of names above, as SGLang's command line spells them.
SGLANG_FLAG_ALIASES = {"pp_size": ("--pipeline-parallel-size",), "dp_size": ("--data-parallel-size",),
                       "dist_init_addr": ("--nccl-init-addr",), "ep_size": ("--expert-parallel-size", "--ep")}

_warned: set[str] = set()

# SGLang's --attention-backend values (0.5.17's choices) that specserve serves with its own
# kernels: NVIDIA's and Intel AMX's (a CPU). FlashAttention 3/4 and FlashInfer are the usual
# settings on an H100/H200; a command line that names one keeps working. AMD's (aiter, wave),
# Ascend's and Intel XPU's name hardware specserve does not run on and stay refused.
SGLANG_ATTENTION_BACKENDS = ("flex_attention", "fa4", "flashinfer", "trtllm_mha", "dual_chunk_flash_attn",
                             "hpc_ops", "cutlass_mla", "flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla",
                             "dsa", "nsa", "dsv4", "compressed", "intel_amx")


def own_attention_backend(value: str) -> str:
    """specserve's attention backend for an --attention-backend value: "auto" (its own
    kernels, one warning a process) for one of SGLang's above, else the value itself."""
    if value not in SGLANG_ATTENTION_BACKENDS:
        return value
    if "attention_backend" not in _warned:
        _warned.add("attention_backend")
        logger.warning("serving SGLang's attention_backend=%r with specserve's own kernels (auto: triton on a GPU, "
                       "torch_native on a CPU)", value)
    return "auto"


def accept_sglang_option(name: str, value: Any) -> None:
    """Check one SGLang-only option (accept_foreign_option)."""
    accept_foreign_option("SGLang", name, value, SGLANG_ONLY_FIELDS[name][0], TUNING.get(name))


def accept_foreign_option(engine: str, name: str, value: Any, default: Any, tuning: str | None) -> None:
    """Check one option of another engine (SGLang's here, vLLM's in vllm_compat) that specserve
    has no setting for: silent at `default`; with `tuning` (what specserve does instead), one
    warning (per process); otherwise a NotSupportedError for a feature specserve lacks."""
    if _same(value, default):
        return
    if tuning is not None:
        if name not in _warned:
            _warned.add(name)
            logger.warning("ignoring %s's %s=%r: %s", engine, name, value, tuning)
        return
    raise NotSupportedError(f"{name}={value!r} asks for a feature of {engine} that specserve does not have; "
                            f"leave it at {engine}'s default ({default!r})")


def _same(value: Any, default: Any) -> bool:
    # "1" from the command line equals 1; a list given as a tuple equals the list; False or
    # an empty value equals an unset (None) default
    if default is None and (value is False or value in ("", [], (), {})):
        return True
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return value == default or (value is not None and default is not None and str(value) == str(default))
