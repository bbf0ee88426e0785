"""The target's forward over a preallocated KV cache, for fast decoding and batched regeneration.

HF's DynamicCache grows by concatenation, so every step has new shapes and runs eagerly from
Python. Here each layer's keys/values live in a buffer of fixed capacity: a forward of T new
tokens writes them at cache columns start..start+T-1 of its row (rows may be at different
columns) and attends over the used columns under a mask (a column is visible when it is at or
before the query's column and, on sliding layers, inside the window); rows of one new token at
their own columns (batched regeneration) read only their own keys where FlashAttention's
variable-length kernel exists (LiveColumns: a CUDA 16-bit target without sliding layers). Fixed
shapes let a step be replayed as a CUDA graph, and a prompt padded at its end to a multiple of
PREFILL_STEP lets its prefill be one too. Nothing is ever cropped: a rejected draft's columns are
masked for every later query and rewritten before they become visible again. A step is bound by
its kernel count, so q/k/v run as one matrix product and gate/up as another (`fused_rows`).

Runs the decoder layers of Llama-layout families (pre-norm, separate q/k/v projections, optional
per-head q/k norms, one RoPE): Llama (SmolLM2), Mistral, Qwen2, Qwen3. Other families decode
through HF's own forward (dflash.eval.speculative's plain path).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from dflash.nn.transformer import LiveColumns, attend, live_columns_supported, rms_norm, rotate
from dflash.target.frozen import SHAPE_FREE_SDPA, FrozenTarget, TargetError
from dflash.target.graphs import GraphReplays
from dflash.target.sampling import Sampling
from dflash.util.runtime import compile_dynamic

FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def fast_decoding_supported(target: FrozenTarget) -> bool:
    return getattr(target.model.config, "model_type", None) in FAST_FAMILIES


# Attention reads the cache only up to the used columns, rounded up to this step: a step over
# the whole capacity reads every row's full buffer (regeneration: 3x slower at 2.9K columns).
SPAN_STEP = 256
# A prompt's prefill is padded to a multiple of this and replays one CUDA graph per padded length:
# run eagerly it is bound by launching its few hundred kernels from Python (10.4 ms a prompt for
# Qwen2.5-Coder-0.5B on an H100, eight greedy steps).
PREFILL_STEP = 128


def fused_rows(module: torch.nn.Module, name: str, linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the rows of `linears`, kept on `module` as `name`: a decode
    step then runs one matrix product where it ran len(linears) (the step is bound by its kernel
    count). The linears' weights become views of the stacked rows, so no second copy is held and
    HF's own forward reads the same numbers. Reused while those views still point into it."""
    fused = module.__dict__.get(name)
    if fused is not None and fused[0].data_ptr() == linears[0].weight.data_ptr():
        return fused
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise TargetError(f"{type(module).__name__}: some of its projections have a bias and some do not, which "
                          "fast decoding cannot stack; use --decoder plain")
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if biases[0] is None else torch.cat(biases)
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight.data = weight[start:start + rows]
            if bias is not None:
                linear.bias.data = bias[start:start + rows]
            start += rows
    module.__dict__[name] = (weight, bias)  # a plain attribute: not a parameter, not in state_dict
    return weight, bias


def layer_windows(config, num_layers: int) -> list[int]:
    """Each layer's sliding window (0: it attends over the whole context)."""
    window = getattr(config, "sliding_window", None) or 0
    # Mistral names no layer types: with a window set, every layer slides.
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * num_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class StaticTarget:
    """A FrozenTarget's decoder run over a static KV cache of `batch` rows x `capacity` columns.

    Two ways to fill it: every row at the same columns (`prefill`, `step`: one sequence per row,
    as speculative decoding runs it), or each row at its own columns (`extend_rows` for a prompt
    entering some rows, `step_rows` for one new token in every row): batched regeneration, where
    a row whose reply has ended takes the next prompt while the others go on. A row's sequence
    always starts at its column 0, so column = position and nothing is padded before a prompt."""

    def __init__(self, target: FrozenTarget, batch: int, capacity: int, cuda_graphs: bool = True,
                 sampling: Sampling | None = None, compiled: bool = False, prefill_step: int | None = None,
                 compiled_prefill: bool = False):
        model = target.model
        config = model.config
        family = getattr(config, "model_type", type(model).__name__)
        if family not in FAST_FAMILIES:
            raise TargetError(f"fast decoding runs {', '.join(FAST_FAMILIES)} targets, not {family}; "
                              "use --decoder plain")
        self.target = target
        self.sampling = sampling  # None: greedy (the target's choice is its argmax)
        self.batch = batch
        self.capacity = round_up(capacity, 16)  # aligned mask rows let SDPA take its fused kernels
        device, dtype = target.device, target.embed_tokens.weight.dtype
        attention = target.layers[0].self_attn
        shape = (len(target.layers), batch, config.num_key_value_heads, self.capacity, attention.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.windows = layer_windows(config, len(target.layers))
        self.feature_layers = set(target.layer_ids)
        self.columns = torch.arange(self.capacity, device=device)
        self._start = torch.zeros((), dtype=torch.long, device=device)
        self._inputs: dict[int, torch.Tensor] = {}
        self._row_columns = torch.zeros(batch, dtype=torch.long, device=device)  # step_rows' input buffer
        self.graphs = GraphReplays(device, cuda_graphs)
        self.compiled = compiled and self.graphs.enabled  # the graphed steps run compiled_layer_parts
        self.compiled_prefill = compiled_prefill  # eager prompts over themselves run dynamic_layer_parts
        # rows at their own columns (step_rows, eager layers) read only their own keys where the kernel exists
        self.live_columns = (not self.compiled
                             and live_columns_supported(device, dtype, attention.head_dim, any(self.windows)))
        # prompts padded to a multiple of this (0: as they are); by default where prefills are graphed
        self.prefill_step = (PREFILL_STEP if self.graphs.enabled else 0) if prefill_step is None else prefill_step
        self._prompts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (rows, padded length) -> ids, last
        self.qkv = [fused_rows(layer.self_attn, "dflash_qkv", [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                               layer.self_attn.v_proj]) for layer in target.layers]
        self.gate_up = [fused_rows(layer.mlp, "dflash_gate_up", [layer.mlp.gate_proj, layer.mlp.up_proj])
                        for layer in target.layers]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch, in this order), moved to the
        front of the cache: batched regeneration drops rows once no prompt is left for them.
        The batch shrinks, so the CUDA graphs are captured again at the next steps."""
        kept = len(rows)
        for layer in range(self.keys.shape[0]):  # one layer at a time: gathering all would double the cache
            self.keys[layer, :kept] = self.keys[layer, rows]
            self.values[layer, :kept] = self.values[layer, rows]
        self.keys, self.values = self.keys[:, :kept], self.values[:, :kept]
        self.batch = kept
        self._row_columns = self._row_columns[:kept].clone()
        self._inputs.clear()
        self._prompts.clear()
        self.graphs = GraphReplays(self.target.device, self.graphs.enabled)

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [batch, P] at columns 0.. of every row -> (the target's choice after the last
        position [batch, 1], features [batch, P, K*D]). With `prefill_step`, the prompts are padded
        to its next multiple and the forward replays one CUDA graph per padded length (its outputs
        are overwritten by the next replay). The padding writes its columns too: like a rejected
        draft's, they are masked for every later query and rewritten before they come into view."""
        self._at(0, ids)
        length = ids.shape[1]
        if not self.prefill_step:
            last = torch.full((ids.shape[0],), length - 1, device=ids.device)
            return self._forward(ids, self._shared_columns(ids.shape), None, last=last, features=True)
        shape = (ids.shape[0], self._padded(length))
        if shape not in self._prompts:
            self._prompts[shape] = (torch.zeros(shape, dtype=torch.long, device=ids.device),
                                    torch.zeros(shape[0], dtype=torch.long, device=ids.device))
        tokens, last = self._prompts[shape]
        tokens[:, :length] = ids  # the padding's tokens are whatever the buffer held
        last.fill_(length - 1)
        choice, features = self.graphs(("prefill", shape), lambda: self._forward(
            tokens, self._shared_columns(shape), None, last=last, features=True))
        return choice, features[:, :length]

    def prepare(self, prompt: int, tokens: int, end: int) -> None:
        """Capture (and compile) the graphs that a prompt of `prompt` tokens replays, then steps of
        `tokens` new tokens up to column `end`: a decoding timed after this times replays alone.
        It runs those forwards on zeros: the cache holds nothing to keep until the next prefill."""
        if not self.graphs.enabled:
            return
        zeros = torch.zeros((self.batch, max(prompt, tokens)), dtype=torch.long, device=self.target.device)
        ends = [*range(prompt + tokens, end, SPAN_STEP), end]
        for span in sorted({self.attended_columns(column) for column in ends}):
            if (tokens, span) not in self.graphs:
                self.step(zeros[:, :tokens], span - tokens)
        if self.prefill_step and (self.batch, self._padded(prompt)) not in self._prompts:
            self.prefill(zeros[:, :prompt])

    def _padded(self, length: int) -> int:
        return min(round_up(length, self.prefill_step), self.capacity)

    def step(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens [batch, T] at columns start.. of every row -> (the target's choice after
        each [batch, T], features [batch, T, K*D]). Replays one CUDA graph per T and span of used
        columns; the outputs are overwritten by the next replay."""
        self._at(start, ids)
        span = self.attended_columns(start + ids.shape[1])
        if not self.graphs.enabled:
            return self._forward(ids, self._shared_columns(ids.shape), span, features=True)
        if ids.shape[1] not in self._inputs:  # made once: a replay queues nothing else but its input's copy
            self._inputs[ids.shape[1]] = torch.zeros_like(ids)
        buffer = self._inputs[ids.shape[1]]
        buffer.copy_(ids)
        return self.graphs((ids.shape[1], span), lambda: self._forward(
            buffer, self._shared_columns(buffer.shape), span, features=True, compiled=self.compiled, shared=True))

    def extend_rows(self, ids: torch.Tensor, rows: torch.Tensor, start: int, last: torch.Tensor) -> torch.Tensor:
        """Tokens [k, T] at columns start.. of the cache rows `rows` [k], eagerly (a prompt, or a
        chunk of one, entering those rows; the other rows are untouched) -> the target's choice
        [k, 1] after position `last` [k] of each row's T. At start 0 the tokens attend only to
        each other: whatever the rows held before is never read."""
        if start + ids.shape[1] > self.capacity:
            raise ValueError(f"decoding past the cache: {start + ids.shape[1]} > {self.capacity} columns")
        columns = (start + self.columns[: ids.shape[1]])[None].expand(ids.shape[0], -1)
        span = None if start == 0 else self.attended_columns(start + ids.shape[1])
        choice, _ = self._forward(ids, columns, span, rows=rows, last=last)
        return choice

    def step_rows(self, ids: torch.Tensor, columns: torch.Tensor, end: int) -> torch.Tensor:
        """One new token per row, ids [batch, 1] each at its own column `columns` [batch] ->
        the target's choice after it [batch, 1]. `end` bounds the columns in use (every
        columns[i] < end), known to the caller without reading `columns` back. Replays one CUDA
        graph per span; the output is overwritten by the next replay."""
        if end > self.capacity:
            raise ValueError(f"decoding past the cache: column {end - 1} >= {self.capacity} columns")
        own_keys = self.live_columns
        span = self.capacity if own_keys else self.attended_columns(end)  # own keys: one graph for all
        buffer = self._inputs.setdefault(-1, torch.zeros_like(ids))
        buffer.copy_(ids)
        self._row_columns.copy_(columns)
        return self.graphs(("rows", span), lambda: self._forward(buffer, self._row_columns[:, None], span,
                                                                  compiled=self.compiled, own_keys=own_keys)[0])

    def _at(self, start: int, ids: torch.Tensor) -> None:
        if start + ids.shape[1] > self.capacity:
            raise ValueError(f"decoding past the cache: {start + ids.shape[1]} > {self.capacity} columns")
        self._start.fill_(start)

    def _shared_columns(self, shape: torch.Size) -> torch.Tensor:
        """Columns [b, T] of a forward at the same columns in every row, from start (a buffer)."""
        return (self._start + self.columns[: shape[1]])[None].expand(shape[0], -1)

    def attended_columns(self, end: int) -> int:
        """The cache columns every row's attention reads in a forward whose columns end before
        `end`: the used span, rounded up to SPAN_STEP, whatever each row's own length."""
        return min(self.capacity, round_up(end, SPAN_STEP))

    def _masks(self, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype, repeat: int) -> list[torch.Tensor]:
        """Each layer's additive attention mask [b, 1, repeat x T, S] (0: visible, -inf: not) for
        queries at columns [b, T] over keys at columns [b or 1, S], built once per forward: a key
        is visible at or before the query's column and, on a sliding layer, inside the window.
        Every query sees at least its own column."""
        query, key = queries[:, :, None], keys[:, None, :]
        visible = key <= query  # [b, T, S]
        masks = {}
        for window in set(self.windows):
            sees = visible & (key > query - window) if window else visible
            additive = torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, float("-inf"))
            masks[window] = additive[:, None].repeat(1, 1, repeat, 1)
        return [masks[window] for window in self.windows]

    def _forward(self, ids: torch.Tensor, columns: torch.Tensor, span: int | None, rows: torch.Tensor | None = None,
                 last: torch.Tensor | None = None, features: bool = False, compiled: bool = False,
                 shared: bool = False, own_keys: bool = False):
        """Tokens ids [b, T] at cache columns [b, T] of the cache rows `rows` (None: all, in
        order), attending over cache columns :span (None: only over themselves) -> (choice after
        each position, or after position `last` [b] of each row; features [b, T, K*D] or None).
        `compiled`: the layers run compiled_layer_parts (the graphed steps); `shared`: every row's
        columns are the same, so the compiled projection writes the cache itself; `own_keys`: one
        token per row, each attending over its own columns only (LiveColumns, step_rows). With
        compiled_prefill, tokens attending only over themselves run dynamic_layer_parts."""
        target = self.target
        x, delta = target.embed_tokens(ids), None  # the residual stream is x + delta (finish_layer)
        cos, sin = rope_tables(target, x, columns)  # a row's column is its position
        if own_keys:  # the whole caches go in
            masks = [LiveColumns((columns[:, 0] + 1).to(torch.int32))] * len(target.layers)
            span = self.capacity
        elif span is None and not any(self.windows):  # a fresh prompt over itself: causal, no mask (finish_layer)
            masks = [None] * len(target.layers)
        else:
            keys = columns if span is None else self.columns[None, :span]
            masks = self._masks(columns, keys, x.dtype, target.model.config.num_attention_heads // self.keys.shape[2])
        project, project_write, finish = compiled_layer_parts() if compiled else (project_qkv, None, finish_layer)
        if self.compiled_prefill and not compiled and all(mask is None for mask in masks):
            project, finish = dynamic_layer_parts()  # prompts of every shape: one compilation
        write_inside = compiled and shared and rows is None and span is not None
        hkv = self.keys.shape[2]
        captured = {}
        for index, layer in enumerate(target.layers):
            if write_inside:
                cache_keys, cache_values = self.keys[index], self.values[index]
                q, x = project_write(layer, self.qkv[index], x, delta, cos, sin, hkv, cache_keys, cache_values,
                                     columns[0])
                keys, values = cache_keys[:, :, :span], cache_values[:, :, :span]
            else:
                q, k, v, x = project(layer, self.qkv[index], x, delta, cos, sin, hkv)
                keys, values = self._cached(index, k, v, columns, span, rows)
            if features and index - 1 in self.feature_layers:  # x: the previous layer's output
                captured[index - 1] = x
            x, delta = finish(layer, self.gate_up[index], x, q, keys, values, masks[index], hkv)
        x = x + delta
        if features and len(target.layers) - 1 in self.feature_layers:
            captured[len(target.layers) - 1] = x
        if last is not None:  # a prefill's logits for every position would be [b, P, vocab]
            x = x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        logits = target.lm_head(rms_norm(target.decoder.norm, x))
        choice = logits.argmax(-1) if self.sampling is None else self.sampling.choose(logits)
        return choice, torch.cat([captured[i] for i in target.layer_ids], dim=-1) if features else None

    def _cached(self, index, k, v, columns, span, rows):
        """Write the new keys/values k, v [b, Hkv, T, d] at their columns of layer `index`'s
        cache (rows `rows`, None: all) -> the keys and values the queries attend over."""
        b, hkv, t, d = k.shape
        cache_keys, cache_values = self.keys[index], self.values[index]
        if rows is None:  # every row, in place: one scatter each
            at = columns[:, None, :, None].expand(b, hkv, t, d)
            cache_keys.scatter_(2, at, k)
            cache_values.scatter_(2, at, v)
        else:
            at = (rows[:, None, None], torch.arange(hkv, device=k.device)[None, :, None], columns[:, None, :])
            cache_keys.index_put_(at, k)
            cache_values.index_put_(at, v)
        if span is None:  # a fresh prompt sees only itself
            return k, v
        if rows is None:
            return cache_keys[:, :, :span], cache_values[:, :, :span]
        return cache_keys[rows, :, :span], cache_values[rows, :, :span]


def rope_tables(target: FrozenTarget, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's RoPE cos and signed sin (`rotate`'s) at positions [b, T], shaped [b, 1, T, d]."""
    cos, sin = target.decoder.rotary_emb(x, positions)
    half = cos.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]


def project_qkv(layer, qkv: tuple, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                hkv: int):
    """A decoder layer up to its attention, its input the residual stream x + delta [b, T, D] (the
    previous layer's last addition is made here: compiled, it shares a kernel with this layer's
    norm; None: nothing to add) -> q, k and v [b, Hkv, T, d], RoPE applied (and Qwen3's per-head
    norms before it), and the input x + delta. q comes as the query heads that share a key/value
    head laid out as rows of it, [b, Hkv, group x T, d] (row r x T + t: head g x group + r at
    position t): GQA without a copy of the cache, and, compiled, the layout is written by the RoPE
    kernel rather than copied before the attention. `qkv`: the layer's stacked projection."""
    if delta is not None:
        x = x + delta
    attention = layer.self_attn
    b, t, _ = x.shape
    d = attention.head_dim
    projected = F.linear(rms_norm(layer.input_layernorm, x), *qkv).view(b, t, -1, d)  # [b, T, Hq + 2 Hkv, d]
    heads = projected.shape[2] - 2 * hkv
    if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
        qk = torch.cat([rms_norm(attention.q_norm, projected[:, :, :heads]),
                        rms_norm(attention.k_norm, projected[:, :, heads:heads + hkv])], dim=2)
    else:
        qk = projected[:, :, :heads + hkv]
    qk = rotate(qk.transpose(1, 2), cos, sin)  # [b, Hq + Hkv, T, d]
    q = qk[:, :heads].reshape(b, hkv, heads // hkv * t, d)
    return q, qk[:, heads:], projected[:, :, heads + hkv:].transpose(1, 2), x


def project_and_write(layer, qkv: tuple, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, hkv: int, cache_keys: torch.Tensor, cache_values: torch.Tensor,
                      columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """project_qkv, and its k and v written at cache columns `columns` [T] of every row of one
    layer's caches [b, Hkv, capacity, d] -> q, x + delta. Compiled, the writes land in the
    projection's own kernel, in place: Inductor runs index_copy_ on the cache itself (a scatter_
    it would run on a copy of the whole cache, then copy back)."""
    q, k, v, x = project_qkv(layer, qkv, x, delta, cos, sin, hkv)
    cache_keys.index_copy_(2, columns, k)
    cache_values.index_copy_(2, columns, v)
    return q, x


def finish_layer(layer, gate_up: tuple, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the decoder layer: attention of q (project_qkv's rows layout) over keys/values
    and its output projection, added to the residual x [b, T, D]; then the MLP -> (that sum, the
    MLP's output): the layer's output is their sum, made by the next layer's projection.
    `gate_up`: the layer's stacked projection. `mask` None: a fresh prompt's tokens attending over
    themselves, causally, in the [b, Hq, T, d] layout whose causal kernels skip the masked half
    (under a dense mask a prefill computed that half too, and read the mask)."""
    attention = layer.self_attn
    b, t = x.shape[:2]
    d = q.shape[-1]
    heads = q.shape[2] // t * hkv
    if mask is None:
        with sdpa_kernel(SHAPE_FREE_SDPA):  # prompts come in every length: no cuDNN plan per shape
            out = F.scaled_dot_product_attention(q.view(b, heads, t, d), keys, values, is_causal=True,
                                                 scale=attention.scaling, enable_gqa=heads != hkv)
    else:
        out = attend(q, keys, values, mask, attention.scaling)
    x = x + attention.o_proj(out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, -1))
    gate, up = gate_and_up(rms_norm(layer.post_attention_layernorm, x), *gate_up)
    return x, layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


def gate_and_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up projections of x [b, T, D] by their stacked weight [2 I, D], one
    matrix product. Eager, it writes them as two contiguous [b, T, I] halves: on halves cut from
    one [b, T, 2 I] output, SiLU and the product ran PyTorch's strided (unvectorized) elementwise
    kernel, 24 of a prefill chunk's 82 ms (`dflash.benchmarks.regen_step --shapes 100x1536x320
    --profile`, Qwen2.5-Coder-0.5B's shapes, H100). Compiled, Inductor reads the strided halves
    in its own fused kernel, so the plain product stays."""
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias).chunk(2, dim=-1)
    b, t, _ = x.shape
    halves = torch.matmul(x.reshape(1, b * t, -1), weight.view(2, -1, weight.shape[-1]).transpose(1, 2))
    if bias is not None:
        halves = halves + bias.view(2, 1, -1)
    return halves[0].view(b, t, -1), halves[1].view(b, t, -1)


@functools.cache
def dynamic_layer_parts():
    """project_qkv and finish_layer compiled once for every shape (dynamic), for forwards of fresh
    prompts over themselves whose batch and length change each call: training's target forward
    (--target-forward decoder) and, with compiled_prefill, the regeneration's prefills."""
    return compile_dynamic(project_qkv), compile_dynamic(finish_layer)


_compiled_parts = None


def compiled_layer_parts():
    """project_qkv, project_and_write and finish_layer compiled, once per process, for the steps
    replayed as CUDA graphs: compiled, a layer's elementwise work (norms, RoPE, the cache write,
    residuals, the MLP's gate) fuses into few kernels, and a graphed step is bound by its kernel
    count. The cache write joins the projection where every row writes the same columns (batch-1
    decoding); rows at their own columns write it eagerly. One compilation serves every layer
    but the first, which has no residual to add (their modules' weights and caches are its
    inputs). Batch-1 decoding uses them; regeneration does not, since its batches change shape and
    each shape compiles again."""
    global _compiled_parts
    if _compiled_parts is None:
        _compiled_parts = (torch.compile(project_qkv), torch.compile(project_and_write), torch.compile(finish_layer))
    return _compiled_parts
