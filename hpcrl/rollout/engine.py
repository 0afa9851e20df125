"""Reference generation engine: a transformers MoE causal LM decoding with a KV cache, SGLang sampling rules.

`ReferenceModel` builds the HuggingFace transformers class of an HF `config.json` dict (random
init from a seed, nothing downloaded), takes weights under HF *checkpoint* names (the names SGLang's
`load_weights` reads, see `hf_names`), and generates for a batch of ragged prompts in one left-padded
batch: a prefill forward, then one forward per new token over a `DynamicCache`, with explicit
position ids so padding changes nothing. A Qwen3-MoE model decodes through `DirectForward`
(direct_forward.py: the model in torch ops, HF's logits within ~2e-7, far fewer ops); every other
model (Mixtral, DeepSeek-V3/V2) through transformers' own forward. For DeepSeek's multi-head latent
attention the DynamicCache holds each layer's compressed latents (the normed kv_lora_rank part and
the roped shared key, one "head" each), which transformers expands through kv_b_proj at every step.

Sampling follows SGLang 0.5.x (`SamplingParams`, `Sampler`, `Req.update_finish_state`):
  * temperature below 1e-6 is greedy (SGLang turns it into top_k=1 at temperature 1); otherwise the logits are
    divided by the temperature, top-k and top-p (drop a token when the mass sorted before it already
    exceeds top_p) are applied to the same sorted probabilities, as in SGLang's PyTorch sampling
    fallback (its flashinfer kernel renormalises after top-k first), and one token is drawn from the
    renormalised rest.
  * a request ends with {"type": "stop", "matched": id} when it emits an EOS id of the model config or
    one of `stop_token_ids` (`ignore_eos` disables both), else with {"type": "length", "length": n} once
    it has n = max_new_tokens tokens: the stop is checked first, as SGLang 0.5.23's
    `Req.update_finish_state` does, so a stop token in the last allowed place is a stop. The stop token is part of
    output_ids. An input of context_len - 6 tokens or more, or one whose max_new_tokens would pass
    context_len, is refused as SGLang refuses it (400); max_new_tokens is then capped like SGLang's
    scheduler: min(max_new_tokens, context_len - 2 - prompt_len).
  * `sampling_seed`: each request draws its uniforms from its own torch.Generator seeded with it
    (requests without one get 42, as SGLang's deterministic inference gives them), and a token is
    picked by inverse CDF over the filtered, sorted probabilities. A request's tokens therefore do
    not depend on which other requests share its batch. The random stream is hpcrl's own: the same
    seed gives different tokens on a real SGLang server.

Returned log-probs: for every output token, log_softmax(logits / T)[token] with T the request's
temperature (T = 1 for greedy), taken before top-k/top-p filtering. This is SGLang's default
definition of `output_token_logprobs` (its sampler computes log-probs of the temperature-scaled
distribution, before filtering, unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, in which case it returns
raw log_softmax(logits)); a trainer recomputing log-probs at the same temperature gets the same numbers.
With `fp32_lm_head` (SGLang's --enable-fp32-lm-head; rollout.fp32_lm_head) the LM head runs in float32
on the model-dtype hidden states (direct_forward.lm_head_logits), so a bf16 engine's logits are not
rounded to bf16; in a float32 engine it changes nothing.

Routed experts (SGLang's --enable-return-routed-experts, issue 33): with `return_routes`, a request's
result also holds `routed_experts`, int32 [P + R - 1, num_hidden_layers, top_k]: row i is the top-k
each MoE layer chose for the token at absolute position i when it was a forward input (prompt tokens
in the prefill, each fed-back output token in its decode step; the last output token was never an
input and has no row), expert ids logical in [0, num_experts). Dense layers' rows are zeros, as SGLang's
zero-initialised capture buffer leaves them. Left padding never reaches a row. The ids are the ones the
forward used: DirectForward's own top-k, or a forward hook on each router (`mlp.gate`, whose outputs
are (logits, weights, ids) of the chosen experts) around transformers' forward; nothing is recorded
without `return_routes`. Column order within a row: descending router weight, i.e. descending
probability: the softmax probability of Qwen3-MoE, Mixtral and DeepSeek-V2 (its greedy top-k, times
routed_scaling_factor), the sigmoid score of DeepSeek-V3 (which chose them with its bias added).
DeepSeek's routers pick with torch.topk(sorted=False), so the hook sorts their ids by weight. SGLang's
order depends on its kernel: compare rows as sets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from hpcrl.rollout.direct_forward import DirectForward, lm_head_logits
from hpcrl.rollout.hf_names import model_slots
from moe.hf_megatron import mtp_names, transformers_model_type

__all__ = ["ReferenceModel", "SamplingParams"]

# Keys SGLang accepts that the reference engine does not implement: allowed only at these
# (inert) values so a request that relies on them fails loudly instead of being half-served. null is
# the default for every one of them (SGLang's SamplingParams.__post_init__), an empty grammar string
# unset, and an empty logit_bias biases nothing.
_INERT_DEFAULTS: dict[str, tuple] = {
    "min_p": (0, 0.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,), "stop": ("", ()),
    "stop_regex": ("", ()), "json_schema": ("",), "regex": ("",), "ebnf": ("",), "structural_tag": ("",),
    "logit_bias": ({},), "custom_params": (), "beam_width": (), "watermark": (),
}
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
SAMPLING_EPS = 1e-6
"""SGLang 0.5.23's _SAMPLING_EPS: a temperature below it is greedy (SamplingParams.greedy)."""
UNSEEDED = 42
"""The seed of a request without sampling_seed: SGLang 0.5.23's in deterministic inference, which hpcrl
runs it with (SamplingBatchInfo.from_schedule_batch): identical unseeded requests sample alike."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling parameters, validated; field names and defaults are SGLang's."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, params: Mapping | None) -> SamplingParams:
        """Parse an SGLang `sampling_params` dict; ValueError names the bad key and value."""
        params = dict(params or {})
        kwargs = {}
        for key, value in params.items():
            if key in _FIELDS:
                if value is not None:
                    kwargs[key] = value
                elif key == "max_new_tokens":
                    kwargs[key] = 1 << 30  # SGLang: no limit but the context (capped in generate)
            elif key in _INERT_DEFAULTS:
                if value is not None and value not in _INERT_DEFAULTS[key] \
                        and not (key in ("stop", "stop_regex") and value == []):
                    default = _INERT_DEFAULTS[key][0] if _INERT_DEFAULTS[key] else None
                    raise ValueError(f"sampling_params.{key}={value!r} is not supported by the reference "
                                     f"engine; leave it at its default {default!r}")
            elif key not in _TEXT_ONLY:
                raise ValueError(f"unknown sampling_params key {key!r}; supported: "
                                 f"{sorted(_FIELDS | set(_INERT_DEFAULTS) | _TEXT_ONLY)}")
        if isinstance(kwargs.get("stop_token_ids"), list):
            kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
        out = cls(**kwargs)
        out._validate()
        return out

    @property
    def greedy(self) -> bool:
        """SGLang 0.5.23 samples 0 <= temperature < 1e-6 greedily, as top_k=1 at temperature 1
        (SamplingParams, _SAMPLING_EPS): the log-probs are then at temperature 1."""
        return self.temperature < SAMPLING_EPS

    def _validate(self) -> None:
        def bad(field: str, why: str):
            return ValueError(f"sampling_params.{field}={getattr(self, field)!r}: {why}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integer token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be true or false")
        if self.sampling_seed is not None and not (_is_int(self.sampling_seed)
                                                   and -2**63 <= self.sampling_seed < 2**63):
            raise bad("sampling_seed", "must be an integer in [-2**63, 2**63 - 1]")


_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def latent_norms_at_config_eps(model: torch.nn.Module, config) -> None:
    """DeepSeek's MLA normalises its q and kv latents (q_a_layernorm, kv_a_layernorm) with eps 1e-6 in
    transformers, whatever config.json says; SGLang 0.5.23 (models/deepseek_v2.py) and Megatron with
    config.rms_norm_eps. Set them to rms_norm_eps, as SGLang builds them."""
    for module in model.modules():
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(module, name, None)
            if norm is not None and hasattr(norm, "variance_epsilon"):
                norm.variance_epsilon = float(config.rms_norm_eps)


class ReferenceModel:
    """A transformers causal LM built from an HF config dict, with SGLang-style batched generation.

    Not thread-safe: callers serialise `generate` and `load_weights` (the server holds one lock).
    """

    def __init__(self, hf_config: Mapping, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, fp32_lm_head: bool = False) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(hf_config)
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise ValueError("hf_config has no 'model_type'; pass a HuggingFace config.json dict")
        cfg.pop("dtype", None)
        cfg.pop("torch_dtype", None)
        self.model_type = model_type  # config.json's, reported as SGLang's hf_config.model_type is
        self.config = AutoConfig.for_model(transformers_model_type(model_type), **cfg)
        self.device = torch.device(device)
        self.dtype = dtype
        self.fp32_lm_head = fp32_lm_head  # SGLang's --enable-fp32-lm-head (a no-op in float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        latent_norms_at_config_eps(model, self.config)
        self.model = model.to(self.device).eval().requires_grad_(False)
        direct = DirectForward.refusal(self.model) is None
        self._forward = DirectForward(self.model, fp32_lm_head) if direct else self._hf_forward  # [B, 1, V]
        # (global layer index, router) of every MoE layer; dense layers have no `experts`
        self.routers = [(i, layer.mlp.gate) for i, layer in enumerate(self.model.model.layers)
                        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]
        self.num_layers: int = self.config.num_hidden_layers
        self.top_k: int = getattr(self.config, "num_experts_per_tok", 0) or 0
        self.slots = model_slots(self.model)
        self._params = self.model.state_dict(keep_vars=True)
        self._views: dict[str, torch.Tensor] = {}  # HF name -> view of the model's weight, made once
        self.vocab_size: int = self.config.vocab_size
        self.context_len: int = self.config.max_position_embeddings
        eos = self.config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else \
            (() if eos is None else (int(eos),))
        self.pad_token_id: int = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        self.skipped_mtp: list[str] = []  # on-disk MTP tensors the last load_model_dir left out

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors given under HF checkpoint names into the model; returns how many were loaded.

        Any subset in any order. Every name and shape is checked before anything is written, so a
        bad call changes nothing: an unknown name or a wrong shape raises ValueError naming it.
        `lm_head.weight` of a model with tied embeddings is skipped, as SGLang does.
        """
        todo = []
        for name, tensor in named_tensors:
            slot = self.slots.get(name)
            if slot is None:
                if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
                    continue
                raise ValueError(f"unknown weight name {name!r}; expected HF checkpoint names such as "
                                 f"{list(self.slots)[:3]} ({len(self.slots)} in all)")
            target = self._views.get(name)
            if target is None:
                target = self._views[name] = self._view(slot)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {list(tensor.shape)}, the model expects "
                                 f"{list(target.shape)}")
            todo.append((target, tensor))
        if todo:
            with torch.no_grad():
                torch._foreach_copy_([t for t, _ in todo], [x for _, x in todo])
        return len(todo)

    def load_model_dir(self, model_dir: str) -> int:
        """Load every weight of a HF model directory (per-expert or fused safetensors, one tensor at a
        time, read and checked by moe.hf_checkpoint); returns how many were loaded.

        DeepSeek's multi-token-prediction layers (`model.layers.{num_hidden_layers + k}.*`, k <
        num_nextn_predict_layers) are not part of the model transformers builds: they are not loaded
        (SGLang loads them only into a speculative-decoding draft model, which this engine does not
        run), and `skipped_mtp` lists their on-disk names. Any other tensor the model lacks is refused,
        and so is a directory without one the model has: CheckpointFormatError or ValueError names it,
        before anything is written."""
        from moe.hf_checkpoint import HFCheckpoint, weight_files
        from moe.hf_megatron import HFModelDims

        dims = HFModelDims.from_hf_config(self.config.to_dict())
        layers = self.config.num_hidden_layers
        nextn = getattr(self.config, "num_nextn_predict_layers", 0) or 0
        with HFCheckpoint(model_dir, dims) as ckpt:
            mtp = set(mtp_names(ckpt.expected, layers, nextn))
            names = [name for name in ckpt.expected if name not in mtp]
            unknown = [name for name in names if name not in self.slots]
            missing = sorted(set(self.slots) - set(names))
            if unknown or missing:
                what, name = ("a tensor the model does not have", unknown[0]) if unknown else \
                    ("no tensor for the model's weight", missing[0])
                raise ValueError(f"{model_dir}: moe.hf_checkpoint reads {what}, {name!r} "
                                 f"({len(unknown) or len(missing)} in all), for model_type "
                                 f"{self.model_type!r}; its HFModelDims.hf_shapes and transformers' "
                                 "model disagree: fix hf_shapes for this family")
            loaded = sum(self.load_weights([(name, ckpt.read(name))]) for name in names)
        self.skipped_mtp = mtp_names(weight_files(Path(model_dir)), layers, nextn)
        return loaded

    def get_weight(self, name: str) -> torch.Tensor:
        """A copy of one tensor under its HF checkpoint name (ValueError if unknown)."""
        if name not in self.slots:
            raise ValueError(f"unknown weight name {name!r}; expected HF checkpoint names such as "
                             f"{list(self.slots)[:3]}")
        return self._view(self.slots[name]).detach().clone()

    def _view(self, slot) -> torch.Tensor:
        pname, index = slot
        return self._params[pname].data[index]

    def to_device(self, device: str | torch.device) -> None:
        """Move the weights (used to release and resume accelerator memory)."""
        self.model.to(device)
        self._params = self.model.state_dict(keep_vars=True)
        self._views = {}

    # -- generation ----------------------------------------------------------------------------

    def max_new_tokens_for(self, prompt_len: int, requested: int, given: bool = False) -> int:
        """SGLang 0.5.23's limits, in its order: an input of context_len tokens or more, then input +
        max_new_tokens over context_len when the request `given` max_new_tokens (not absent or null:
        `TokenizerManager._validate_one_request`, without --allow-auto-truncate), then an input of
        context_len - 6 or more (the scheduler's max_req_input_len = context_len - 1 - 5) are refused
        (ValueError, SGLang's message); else the scheduler's cap min(requested, context_len - 2 - prompt_len)."""
        ctx = self.context_len
        if prompt_len >= ctx:
            raise ValueError(f"The input ({prompt_len} tokens) is longer than the model's context length "
                             f"({ctx} tokens).")
        if given and prompt_len + requested > ctx:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                             f"You requested a total of {prompt_len + requested} tokens: {prompt_len} tokens from "
                             f"the input messages and {requested} tokens for the completion. Please reduce the "
                             f"number of tokens in the input messages or the completion to fit within the limit.")
        if prompt_len >= ctx - 6:
            raise ValueError(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({ctx - 6} "
                             f"tokens). Use a shorter input or enable --allow-auto-truncate.")
        return min(requested, ctx - 2 - prompt_len)

    def routes_refusal(self) -> str | None:
        """Why this model cannot return routed experts (no MoE layer), or None."""
        if not self.routers or self.top_k < 1:
            return (f"model_type {self.model_type!r} with these settings has no MoE layer "
                    "(no router): there are no routed experts to return")
        return None

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[Sequence[int]],
                 sampling_params: Sequence[Mapping | SamplingParams],
                 return_routes: bool | Sequence[bool] = False) -> list[dict]:
        """Generate for every prompt; one dict per request with output_ids, finish_reason, output_logprobs,
        and, for the requests `return_routes` selects (one bool for all, or one per prompt),
        routed_experts.

        `output_logprobs[i]` is log_softmax(logits / T)[output_ids[i]] (T = 1 when greedy);
        `routed_experts` is an int32 tensor [P + R - 1, num_hidden_layers, top_k] (see the module
        docstring). ValueError for malformed prompts or sampling params, or routes asked of a model
        without MoE layers.
        """
        prompts, params, max_new = self._validated(input_ids, sampling_params)
        if not prompts:
            return []
        want = [return_routes] * len(prompts) if isinstance(return_routes, bool) else list(return_routes)
        if len(want) != len(prompts):
            raise ValueError(f"return_routes has {len(want)} entries for {len(prompts)} prompts")
        if any(want) and self.routes_refusal():
            raise ValueError(self.routes_refusal())
        seeds = [UNSEEDED if sp.sampling_seed is None else sp.sampling_seed for sp in params]
        num_steps = max(max_new)
        if num_steps == 0 and not any(want):
            return [_result([], [], {"type": "length", "length": 0}) for _ in prompts]
        # With routes, max_new_tokens 0 still runs the prefill (as SGLang does): its rows are the routes.
        tokens_BT, logprobs_BT, lengths_B, stopped_B, routes = self._decode(
            prompts, params, max_new, seeds, max(num_steps, 1), any(want))
        out, max_len = [], max(len(p) for p in prompts)
        rows = zip(lengths_B.tolist(), tokens_BT.tolist(), logprobs_BT.tolist())
        for b, (n, ids, logprobs) in enumerate(rows):
            ids = ids[:n]
            reason = {"type": "stop", "matched": ids[-1]} if stopped_B[b] else {"type": "length", "length": n}
            out.append(_result(ids, logprobs[:n], reason))
            if want[b]:  # left padded: the prompt starts at column L - P; the last output token has none
                first = max_len - len(prompts[b])
                out[-1]["routed_experts"] = routes[b, first:max_len + n - 1].clone()
        return out

    def validate(self, input_ids: Sequence[Sequence[int]],
                 sampling_params: Sequence[Mapping | SamplingParams]) -> list[SamplingParams]:
        """Check a request as `generate` would, without running it; ValueError names the problem."""
        return self._validated(input_ids, sampling_params)[1]

    def _validated(self, input_ids, sampling_params):
        if len(input_ids) != len(sampling_params):
            raise ValueError(f"{len(input_ids)} prompts but {len(sampling_params)} sampling_params")
        parsed: dict[int, SamplingParams] = {}  # a batch often repeats one dict object: parse it once
        params = [p if isinstance(p, SamplingParams) else
                  parsed.get(id(p)) or parsed.setdefault(id(p), SamplingParams.from_dict(p))
                  for p in sampling_params]
        prompts = [self._check_prompt(i, p) for i, p in enumerate(input_ids)]
        # A request's own max_new_tokens (a dict: the server checks the body as it came) is held to the
        # context; parsed SamplingParams were checked so already, and absent or null ones are not.
        given = [isinstance(p, Mapping) and p.get("max_new_tokens") is not None for p in sampling_params]
        max_new = [self.max_new_tokens_for(len(p), sp.max_new_tokens, g)
                   for p, sp, g in zip(prompts, params, given)]
        return prompts, params, max_new

    def _check_prompt(self, i: int, prompt: Sequence[int]) -> list[int]:
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"input_ids[{i}] is {type(prompt).__name__}; each prompt is a list of token ids")
        ids = list(prompt)
        if not ids:
            raise ValueError(f"input_ids[{i}] is empty; every prompt needs at least one token")
        if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not _is_int(t) or not 0 <= t < self.vocab_size)
            raise ValueError(f"input_ids[{i}] holds {bad!r}; token ids must be integers in "
                             f"[0, {self.vocab_size})")
        return ids

    def hidden_states(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """The final norm's output at every position, [B, T, H] in the model's dtype, by the forward
        generation runs (DirectForward where it applies, else transformers'), no cache kept: what
        input-token log-probs are computed from (engine_score.py)."""
        from transformers import DynamicCache

        if isinstance(self._forward, DirectForward):
            return self._forward.hidden(input_ids, attention_mask, position_ids, DynamicCache(), every_position=True)
        return self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False).last_hidden_state

    def _hf_forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        if not self.fp32_lm_head:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=True, logits_to_keep=1).logits
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, use_cache=True).last_hidden_state
        return lm_head_logits(hidden[:, -1:], self.model.lm_head.weight, True)

    @contextmanager
    def _recording(self, recorder: _RouteRecorder | None) -> Iterator[None]:
        """Route every MoE layer's chosen experts to `recorder` for the forwards inside (nothing when
        None): DirectForward calls it itself; transformers' forward through hooks on the routers."""
        if recorder is None:
            yield
            return
        if isinstance(self._forward, DirectForward):
            self._forward.on_route = recorder
            try:
                yield
            finally:
                self._forward.on_route = None
            return
        hooks = [gate.register_forward_hook(lambda mod, args, out, i=i: recorder(i, _by_weight(out[1], out[2])))
                 for i, gate in self.routers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _decode(self, prompts, params, max_new, seeds, num_steps, record_routes=False):
        from transformers import DynamicCache

        dev, B, V = self.device, len(prompts), self.vocab_size
        lengths = [len(p) for p in prompts]
        L = max(lengths)
        # Left padding: every row's last prompt token sits at column L - 1, so one cache step serves all.
        tokens_BL = torch.tensor([[self.pad_token_id] * (L - n) + p for p, n in zip(prompts, lengths)])
        mask_BN = torch.ones(B, L + num_steps, dtype=torch.long)
        mask_BN[:, :L] = torch.arange(L)[None, :] >= (L - torch.tensor(lengths))[:, None]
        pos_BL = (mask_BN[:, :L].cumsum(-1) - 1).clamp(min=0)

        greedy_B = torch.tensor([sp.greedy for sp in params])
        temp_B = torch.tensor([1.0 if sp.greedy else float(sp.temperature) for sp in params])
        top_p_B = torch.tensor([float(sp.top_p) for sp in params])
        top_k_B = torch.tensor([V if sp.top_k == -1 else min(sp.top_k, V) for sp in params])
        u_BT = torch.zeros(B, num_steps)
        stop_rows, stop_ids = [], []
        gen = torch.Generator()  # reseeded per request (a new generator per row cost ~2x as much)
        for b, sp in enumerate(params):
            if not sp.greedy:  # a request's uniforms come from its own seed only
                torch.rand(max_new[b], generator=gen.manual_seed(seeds[b]), out=u_BT[b, :max_new[b]])
            if not sp.ignore_eos:
                ids = {t for t in (*self.eos_token_ids, *sp.stop_token_ids) if 0 <= t < V}
                stop_rows += [b] * len(ids)
                stop_ids += ids
        stop_BV = torch.zeros(B, V, dtype=torch.bool)
        stop_BV[stop_rows, stop_ids] = True
        max_new_B = torch.tensor(max_new)
        all_greedy = bool(greedy_B.all())
        # Rules no row uses are left out of the sampler (None): exact, as x / 1.0 == x and a top-k
        # of V drops nothing.
        sampler_args = [greedy_B.to(dev) if greedy_B.any() else None,
                        None if bool((temp_B == 1.0).all()) else temp_B.to(dev),
                        top_p_B.to(dev),
                        None if bool((top_k_B == V).all()) else top_k_B.to(dev)]
        u_BT, stop_BV, mask_BN = u_BT.to(dev), stop_BV.to(dev), mask_BN.to(dev)

        tokens_BT = torch.zeros(B, num_steps, dtype=torch.long, device=dev)
        logprobs_BT = torch.zeros(B, num_steps, device=dev)
        lengths_B = torch.zeros(B, dtype=torch.long, device=dev)
        finished_B = (max_new_B == 0).to(dev)
        stopped_B = torch.zeros(B, dtype=torch.bool, device=dev)
        max_new_B = max_new_B.to(dev)
        rows = torch.arange(B, device=dev)
        cache = DynamicCache(config=self.config)
        ids_in, pos_in = tokens_BL.to(dev), pos_BL.to(dev)
        # Without left padding the mask is all ones: then HF's plain causal path needs none (building
        # the 4-D mask costs ~5% of a tiny model's generation).
        padded = min(lengths) != L
        # The inputs of all forwards: L prompt columns, then one per fed-back token (the last is never fed).
        recorder = _RouteRecorder(B, L + num_steps - 1, self.num_layers, self.top_k, dev) \
            if record_routes else None
        with self._recording(recorder):
            for t in range(num_steps):
                if recorder is not None:
                    recorder.column = 0 if t == 0 else L + t - 1
                logits_BV = self._forward(ids_in, mask_BN[:, :L + t] if padded else None, pos_in,
                                          cache)[:, -1].float()
                tok_B, lp_B = _sample(logits_BV, u_BT[:, t], all_greedy, *sampler_args)
                tokens_BT[:, t] = tok_B
                logprobs_BT[:, t] = lp_B
                active_B = ~finished_B
                lengths_B += active_B
                at_stop_B = active_B & stop_BV[rows, tok_B]  # before the length, as SGLang 0.5.23
                at_len_B = active_B & ~at_stop_B & (lengths_B >= max_new_B)
                stopped_B |= at_stop_B
                finished_B |= at_len_B | at_stop_B
                if t + 1 == num_steps or bool(finished_B.all()):
                    break
                ids_in, pos_in = tok_B[:, None], pos_in[:, -1:] + 1
        routes = None if recorder is None else recorder.routes_BCLK.cpu()
        return tokens_BT.cpu(), logprobs_BT.cpu(), lengths_B.cpu(), stopped_B.tolist(), routes


def _by_weight(weights_NK: torch.Tensor, chosen_NK: torch.Tensor) -> torch.Tensor:
    """A transformers router's chosen ids in descending order of their weights (a stable sort: the
    already sorted top-k of Qwen3-MoE and Mixtral stays as it is; DeepSeek's unsorted one is ordered)."""
    return chosen_NK.gather(-1, weights_NK.argsort(dim=-1, descending=True, stable=True))


class _RouteRecorder:
    """Collects the experts each MoE layer chose for every forward input of a batch, in
    `routes_BCLK` [B, columns, num_layers, top_k] int32 (zeros where no router wrote: dense layers,
    and columns a finished batch never reached). The engine sets `column` before each forward; the
    forward's T inputs per row land in columns [column, column + T)."""

    def __init__(self, batch: int, columns: int, num_layers: int, top_k: int, device) -> None:
        self.routes_BCLK = torch.zeros(batch, columns, num_layers, top_k, dtype=torch.int32, device=device)
        self.column = 0

    def __call__(self, layer: int, chosen_NK: torch.Tensor) -> None:
        """Record layer `layer`'s chosen expert ids, [B * T, top_k] in (row, position) order."""
        B = self.routes_BCLK.shape[0]
        T = chosen_NK.shape[0] // B
        self.routes_BCLK[:, self.column:self.column + T, layer] = chosen_NK.view(B, T, -1)


def _sample(logits_BV, u_B, all_greedy, greedy_B, temp_B, top_p_B, top_k_B):
    """Next token and its log-prob per row (see the module docstring for the rules). `greedy_B`,
    `temp_B` and `top_k_B` are None when no row is greedy, every row is at temperature 1, no row
    filters by top-k."""
    if all_greedy:
        logp_BV = torch.log_softmax(logits_BV, -1)
        tok_B = logits_BV.argmax(-1)
        return tok_B, logp_BV.gather(1, tok_B[:, None])[:, 0]
    logp_BV = torch.log_softmax(logits_BV if temp_B is None else logits_BV / temp_B[:, None], -1)
    probs_sorted_BV, order_BV = logp_BV.exp().sort(-1, descending=True)
    cum_BV = probs_sorted_BV.cumsum(-1)
    drop_BV = (cum_BV - probs_sorted_BV) > top_p_B[:, None]
    if top_k_B is not None:
        rank_V = torch.arange(logits_BV.shape[-1], device=logits_BV.device)
        drop_BV |= rank_V[None, :] >= top_k_B[:, None]
    kept_BV = probs_sorted_BV.masked_fill(drop_BV, 0.0)
    cdf_BV = kept_BV.cumsum(-1)
    threshold_B = u_B * cdf_BV[:, -1]
    pick_B = torch.searchsorted(cdf_BV, threshold_B[:, None], right=True)[:, 0]
    # u * total can round up to total; never step past the last token that kept mass.
    last_kept_B = (kept_BV > 0).sum(-1) - 1
    pick_B = torch.minimum(pick_B, last_kept_B)
    tok_B = order_BV.gather(1, pick_B[:, None])[:, 0]
    if greedy_B is not None:
        tok_B = torch.where(greedy_B, logits_BV.argmax(-1), tok_B)
    return tok_B, logp_BV.gather(1, tok_B[:, None])[:, 0]


def _result(ids: list[int], logprobs: list[float], reason: dict) -> dict:
    return {"output_ids": ids, "output_logprobs": logprobs, "finish_reason": reason}
