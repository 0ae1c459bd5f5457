"""``torch.library`` custom ops for MLA inference on CPU (namespace ``torch.ops.mlafx``).

Importing this package loads the C++ extension ``mlafx._C`` (failing loudly with a rebuild
hint if it is missing or stale) and registers the ops' fake implementations.

- ``extension.py``: loading, build checks, ``library_path()``, ``cpu_isa()``, the
  batch-invariant mode switch
- ``ops.py``: typed wrappers and fakes; the schemas live in ``csrc/<family>.cpp``
- ``reference.py``: slow Python references the tests compare against
- ``attention_ops.py``, ``attention_reference.py``: the attention ops' wrappers/fakes, references
- ``dsa_ops.py``, ``dsa_reference.py``: DeepSeek Sparse Attention (the indexer's top-k, sparse
  absorbed MLA), wrappers/fakes and float64 references
- ``gemm_ops.py``, ``gemm_reference.py``: linears on packed weights, references
- ``moe_ops.py``, ``moe_reference.py``: routed MoE experts, reference
- ``quant_format.py``: the int8/int4 (Q8_0/Q4_0-like) packed weight format and its semantics
- ``quant_ops.py``, ``quant_reference.py``: quantized linears and MoE experts (W8A8), float64
  references
- ``fp8_format.py``, ``fp8_ops.py``, ``fp8_reference.py``: block-scaled FP8 weights as
  DeepSeek publishes them, their linears and MoE experts, float64 references
- ``csrc/``: C++ kernels (``*_avx512.cpp`` compiled with AVX-512 flags, chosen at run time)
"""

from mlafx.kernels.attention_ops import (
    gather_latent,
    merge_attn_states,
    mla_attention_paged,
    varlen_attention,
)
from mlafx.kernels.dsa_ops import dsa_indexer_topk, mla_attention_sparse
from mlafx.kernels.extension import (
    ExtensionLoadError,
    batch_invariant,
    batch_invariant_mode,
    build_sha256,
    cpu_isa,
    library_path,
    load_extension,
    parallel_num_threads,
    set_batch_invariant,
)
from mlafx.kernels.fp4_ops import moe_experts_fp4
from mlafx.kernels.fp8_ops import fp8_cpu_isa, linear_fp8, moe_experts_fp8
from mlafx.kernels.gemm_ops import (
    batched_matmul,
    linear_decode,
    linear_packed,
    pack_linear_weight,
    unpack_linear_weight,
)
from mlafx.kernels.moe_ops import moe_experts
from mlafx.kernels.ops import write_latent_cache
from mlafx.kernels.quant_ops import (
    linear_quantized,
    moe_experts_quantized,
    quant_cpu_isa,
    quantize_linear_weight,
)
from mlafx.kernels.v4_compressor_ops import v4_compress_pool

__all__ = [
    "ExtensionLoadError",
    "batch_invariant",
    "batch_invariant_mode",
    "batched_matmul",
    "build_sha256",
    "cpu_isa",
    "fp8_cpu_isa",
    "dsa_indexer_topk",
    "gather_latent",
    "library_path",
    "linear_decode",
    "linear_fp8",
    "linear_packed",
    "linear_quantized",
    "load_extension",
    "merge_attn_states",
    "mla_attention_paged",
    "mla_attention_sparse",
    "moe_experts",
    "moe_experts_fp4",
    "moe_experts_fp8",
    "moe_experts_quantized",
    "pack_linear_weight",
    "parallel_num_threads",
    "quant_cpu_isa",
    "quantize_linear_weight",
    "set_batch_invariant",
    "unpack_linear_weight",
    "v4_compress_pool",
    "varlen_attention",
    "write_latent_cache",
]
