"""Parkade's decoder for the Llama, Mistral and Qwen2 families, over the paged KV pool.

One forward call computes a flattened batch of tokens from many requests (see
`kernels/metadata.py`):

    input_ids [num_tokens] -> embed -> N x DecoderLayer -> norm -> hidden [num_tokens, hidden_size]
    DecoderLayer: h += o_proj(attn(rope(q), rope(k), v));  h += down(silu(gate(norm(h))) * up(norm(h)))

Parameter names equal the Hugging Face checkpoint names, so loading is a name-checked copy.
Numerics follow transformers where it is cheap: RMSNorm in fp32 cast back before the weight, RoPE
cos/sin computed in fp32 and cast to the model dtype, scale head_dim ** -0.5.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from parkade.kernels import attention_torch
from parkade.kernels.metadata import AttentionMetadata
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.weights import iterate_weights

__all__ = ["AttentionKernels", "DecoderLM", "load_model"]

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


class AttentionKernels(Protocol):
    """What an attention layer calls; `parkade.kernels.attention_torch` (a module) is one.

    A Triton backend provides the same two functions with the same signatures.
    """

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...  # fmt: skip

    def paged_attention_varlen(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float,
        block_table: torch.Tensor, sliding_window: int | None = None, query_lens: tuple[int, ...] = (),
        seq_lens: tuple[int, ...] = (),
    ) -> torch.Tensor: ...  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables `[num_positions, head_dim]` in the model dtype, grown on demand.

    Built from fp32 inverse frequencies exactly as transformers' rotary embedding computes them per
    call (positions * inv_freq in fp32, duplicated halves, cos/sin, cast), so the values are equal.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = config.rope.inv_freq(config.head_dim)  # [head_dim // 2] fp32, CPU
        self.dtype = config.dtype
        self.min_len = config.max_position_embeddings
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` [num_tokens], all < max_len -> cos, sin [num_tokens, 1, head_dim]."""
        if self.cos is None or self.cos.shape[0] < max_len or self.cos.device != positions.device:
            self._build(
                max(max_len, self.min_len, 2 * (0 if self.cos is None else self.cos.shape[0])),
                positions.device,
            )
        assert self.cos is not None and self.sin is not None
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _build(self, length: int, device: torch.device) -> None:
        freqs = torch.arange(length, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim] fp32
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)


class Linear(nn.Linear):
    """`nn.Linear` whose weight may be kept in fp32 while activations stay in the model dtype.

    NOTE: on CPUs without native bf16/fp16 matmuls (AVX2: no AVX512-BF16 or AMX) torch's bf16
    GEMM runs 5-10x slower than fp32. `DecoderLM.use_fp32_matmuls` upcasts the weights (exactly),
    and each product casts its input up and its output back, which is what a bf16 GEMM computes
    anyway (fp32 accumulation, one rounding of the output) up to summation order.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class PackedLinear(nn.Module):
    """Linears of one input, concatenated along their outputs and packed once for the CPU's packed-linear
    kernel (`kernels/linear_cpu.py`: AMX or AVX512-BF16): one call of the op `parkade::linear_amx`
    computes them all.
    `splits` are the parts' output sizes, in order. See `DecoderLM.use_packed_linears`."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        from parkade.kernels import linear_cpu  # registers the op

        super().__init__()
        weight = parts[0][0] if len(parts) == 1 else torch.cat([w for w, _ in parts])  # (a tied head: shared)
        self.packed = nn.Parameter(linear_cpu.pack_weight(weight), requires_grad=False)
        # Steps of many rows (past the kernel's max_rows) go to oneDNN, on its own packed copy, as
        # the compiled forward would have made of every weight. The plain weight is kept only where
        # oneDNN cannot pack it: two copies of the weights in memory, not three.
        self.onednn = linear_cpu.prepack_onednn(weight, owner=self)
        self.weight = nn.Parameter(weight, requires_grad=False) if self.onednn < 0 else None
        self.in_features = weight.shape[1]
        self.bias = None
        if any(b is not None for _, b in parts):
            biases = [torch.zeros(w.shape[0], dtype=w.dtype) if b is None else b for w, b in parts]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        self.out_features = weight.shape[0]
        self.splits = [w.shape[0] for w, _ in parts]

    @classmethod
    def of(cls, *linears: nn.Linear) -> PackedLinear:
        return cls([(linear.weight, linear.bias) for linear in linears])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the op checks it against `weight`, which may be gone
            raise ValueError(f"x has {x.shape[-1]} features, the packed linear {self.in_features}")
        packed, onednn = self.packed, self.onednn
        return torch.ops.parkade.linear_amx(x, packed, self.weight, self.bias, self.out_features, onednn)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [num_tokens, heads, head_dim]; cos/sin [num_tokens, 1, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionKernels) -> None:
        super().__init__()
        hidden, dtype, d = config.hidden_size, config.dtype, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d
        )  # fmt: skip
        self.q_proj = Linear(hidden, self.num_heads * d, bias=config.qkv_bias, dtype=dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias, dtype=dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * d, hidden, bias=config.o_proj_bias, dtype=dtype)
        self.qkv_proj: PackedLinear | None = None  # q/k/v in one, replacing them (use_packed_linears)
        self.scale = d**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.backend = backend  # a plain attribute: swapped by DecoderLM.set_attention_backend
        # Whether the write and attention go through the `parkade::paged_attention` op, which
        # torch.compile keeps whole (DecoderLM.use_attention_op).
        self.as_op = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.splits, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = _apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = _apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.as_op:
            out = torch.ops.parkade.paged_attention(
                q, k, v, k_cache, v_cache, md.slot_mapping, md.cu_seqlens_q, md.seqused_k, md.block_table,
                self.scale, self.sliding_window, self.backend.__name__,
            )  # fmt: skip
            return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        # Write first: this step's queries attend to this step's keys through the pool.
        self.backend.write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
        out = self.backend.paged_attention_varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seqlen_q,
            seqused_k=md.seqused_k, max_seqlen_k=md.max_seqlen_k,
            softmax_scale=self.scale, block_table=md.block_table, sliding_window=self.sliding_window,
            query_lens=md.query_lens, seq_lens=md.seq_lens,
        )  # fmt: skip
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias, dtype = (
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
            config.dtype,
        )
        self.gate_proj = Linear(hidden, inter, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden, inter, bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype)
        self.gate_up_proj: PackedLinear | None = None  # gate and up in one (use_packed_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.splits, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionKernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, layer, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = MLP(config)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, md)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """The `model.` prefix of the checkpoint names: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionKernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)


class DecoderLM(nn.Module):
    """Decoder-only causal LM over a paged KV pool. Build it with `load_model`."""

    def __init__(self, config: ModelConfig, attention_backend: AttentionKernels | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, attention_backend or attention_torch)
        # NOTE: tied embeddings get no lm_head module at all (rather than a shared Parameter), so
        # the parameter names are exactly the checkpoint's and meta-device building cannot untie.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype)
        )
        self.rotary = RotaryEmbedding(config)
        self.logits_weight: torch.Tensor | None = None  # an fp32 copy of a tied head, when upcast
        self.packed_head: PackedLinear | None = None  # the head (tied or not), packed (use_packed_linears)

    def use_fp32_matmuls(self) -> None:
        """Keep every matmul weight in fp32 (see `Linear`); norms, RoPE and the KV cache keep the dtype."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.float()
        if self.lm_head is None:
            self.logits_weight = self.model.embed_tokens.weight.float()

    def use_packed_linears(self) -> None:
        """Compute every matmul with the CPU's packed-linear kernel (`kernels/linear_cpu.py`, bf16 weights),
        on weights packed now: q/k/v in one, gate/up in one, o, down and the head. Each keeps its
        (concatenated) weight too, for steps of many rows; the modules they replace become None.
        A tied head keeps the embedding and adds its copies."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = PackedLinear.of(attn.q_proj, attn.k_proj, attn.v_proj)
            attn.o_proj = PackedLinear.of(attn.o_proj)
            attn.q_proj = attn.k_proj = attn.v_proj = None
            mlp.gate_up_proj = PackedLinear.of(mlp.gate_proj, mlp.up_proj)
            mlp.down_proj = PackedLinear.of(mlp.down_proj)
            mlp.gate_proj = mlp.up_proj = None
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = PackedLinear([(head, None)])
        self.lm_head = None

    def set_attention_backend(self, backend: AttentionKernels) -> None:
        """Route every layer's attention through `backend` (e.g. a Triton one)."""
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def use_attention_op(self) -> None:
        """Call attention through the `parkade::paged_attention` op, for torch.compile to trace around."""
        import parkade.kernels.attention_op  # noqa: F401  (registers the op)

        for layer in self.model.layers:
            layer.self_attn.as_op = True

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, each < attn_metadata.max_seqlen_k
        kv_caches: list[KVCache],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Compute one step's tokens, writing their K/V into the pool; -> hidden [num_tokens, hidden]."""
        cos, sin = self.rotary(positions, attn_metadata.max_seqlen_k)
        return self.run_layers(input_ids, cos, sin, kv_caches, attn_metadata)

    def run_layers(
        self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """`forward` past the rotary tables (cos/sin [num_tokens, 1, head_dim]): what gets compiled."""
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        if self.packed_head is not None:  # bf16 out, as the product below rounds it
            return self.packed_head(hidden).float()
        if self.lm_head is not None:
            weight = self.lm_head.weight
        else:
            weight = self.model.embed_tokens.weight if self.logits_weight is None else self.logits_weight
        # Rounded to the model dtype as a native product would be, so that ties break the same way.
        return F.linear(hidden.to(weight.dtype), weight).to(hidden.dtype).float()


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def load_model(
    config: ModelConfig, device: torch.device | str, attention_backend: AttentionKernels | None = None
) -> DecoderLM:
    """Build the model on `device` in `config.dtype` and copy in every checkpoint weight.

    Raises ValueError naming every missing or unexpected weight, or a shape mismatch.
    """
    # Build on the meta device: no memory and no random init for weights we overwrite anyway.
    with torch.device("meta"):
        model = DecoderLM(config, attention_backend)
    model.to_empty(device=device)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iterate_weights(config.model_dir):
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # a tied checkpoint may still store the (identical) head
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
        param.copy_(tensor)
        loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {config.model_dir} does not match {config.architecture}: "
            f"missing weights {missing}, unexpected weights {sorted(unexpected)}"
        )
    return model.eval()
