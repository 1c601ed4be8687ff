"""Qwen's original releases, read as the source of lily's MLX 4-bit weights: the bf16 safetensors in the
transformers layout, or the block-wise FP8 version of it. Everything is checked from the headers alone.

What the files hold (shared/MODEL.md section 2): the prefix `model.language_model.` (or `model.` when
transformers saved the text model alone), `lm_head.weight` at the top, the MTP head under `mtp.`, the
vision tower under `model.visual.` (skipped); experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate
rows first, `mlp.experts.down_proj` [E, H, I]) or one by one (`mlp.experts.N.{gate,up,down}_proj.weight`);
zero-centred norms; conv1d [C, 1, K]; float tensors in float32, bfloat16 or float16. In the FP8 release a
converted Linear's weight is float8_e4m3fn with `weight_scale_inv` [ceil(out/128), ceil(in/128)] beside it
(float32; some of Qwen's FP8 releases store it in bf16 or f16, read exactly as float32); a module listed in
`modules_to_not_convert` must be stored as a float, and one stored as a float is read as it is.

The plan is a list of jobs: source tensors read together and the lily weights made from them (one, or
two for fused gate_up), in the order of lily's MLX files; quantize_at_load.py turns a job into tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lily.checkpoint.base import CheckpointError
from lily.checkpoint.layout import TensorSpec, expected_tensors
from lily.checkpoint.safetensors_dir import StoredTensor, weight_files
from lily.config import ModelConfig

_FLOATS = ("F32", "BF16", "F16")
_FP8 = "F8_E4M3"
# Not part of the text model: the vision tower.
_VISION = re.compile(r"^(model\.visual\.|visual\.|vision_tower\.)")


@dataclass(frozen=True)
class SourceMatrix:
    """One stored tensor, with its FP8 block scales when it was converted."""

    tensor: StoredTensor
    scale_inv: StoredTensor | None = None

    @property
    def parts(self) -> tuple[StoredTensor, ...]:
        return (self.tensor,) if self.scale_inv is None else (self.tensor, self.scale_inv)


@dataclass(frozen=True)
class Job:
    """Source tensors read together and the lily weights made from them.
    how: "one" (a tensor as it is), "split" (fused gate_up: first half of the rows -> specs[0], second
    half -> specs[1]) or "stack" (one matrix per expert, stacked on a new first dim)."""

    specs: tuple[TensorSpec, ...]
    sources: tuple[SourceMatrix, ...]
    how: str = "one"

    @property
    def parts(self) -> tuple[StoredTensor, ...]:
        return tuple(t for s in self.sources for t in s.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)


@dataclass(frozen=True)
class Fp8Scheme:
    """The FP8 release's quantization_config: block shape and the modules left as floats."""

    block: tuple[int, int]
    not_converted: tuple[str, ...]

    def converted(self, module: str) -> bool:
        """transformers' rule for modules_to_not_convert: a pattern matches from the start of the name up to
        a module boundary (also as a regex), or as a suffix of it."""
        for p in self.not_converted:
            if module.endswith(p):
                return False
            try:
                if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module):
                    return False
            except re.error:
                pass
        return True


def fp8_scheme(cfg: dict, source: str) -> Fp8Scheme | None:
    """The FP8 scheme of an original config.json, None for a float release; anything else is refused."""
    q = cfg.get("quantization_config")
    if q is None or q == {}:  # an empty block (some bf16 uploads carry `{}`) counts as none
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise CheckpointError(f"{source}: quantization_config.quant_method is {method!r}; lily reads Qwen's bf16 "
                              "and block-wise FP8 releases and MLX affine 4-bit checkpoints")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: quantization_config.fmt is {q.get('fmt')!r}; expected 'e4m3'")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{source}: quantization_config.weight_block_size is {block!r}; expected two positive "
                              "integers (block-wise FP8, e.g. [128, 128])")
    skip = q.get("modules_to_not_convert") or []
    if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise CheckpointError(f"{source}: quantization_config.modules_to_not_convert must be a list of names")
    return Fp8Scheme((block[0], block[1]), tuple(skip))


def _scale_name(name: str) -> str:
    return name[:-len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


class _Reader:
    """Resolves lily's weights to the stored tensors, refusing with one line what does not fit."""

    def __init__(self, d: Path, config: ModelConfig, fp8: Fp8Scheme | None, stored: dict[str, StoredTensor]):
        self.d, self.config, self.fp8, self.stored = d, config, fp8, stored
        self.used: set[str] = set()
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in stored) \
            else "model."

    def source_name(self, key: str) -> str:
        """The stored name of a lily key's module or tensor (without `.weight` for modules)."""
        if key == "lm_head" or key.startswith("mtp."):
            return key
        return self.prefix + key

    def _get(self, name: str, what: str) -> StoredTensor:
        t = self.stored.get(name)
        if t is None:
            raise CheckpointError(f"{self.d}: missing tensor {name} ({what})")
        self.used.add(name)
        return t

    def _file(self, name: str) -> Path:
        return self.stored[name].file

    def matrix(self, name: str, shape: tuple[int, ...], module: str) -> SourceMatrix:
        """A Linear (or stacked experts) weight: a float tensor, or FP8 with its block scales."""
        t = self._get(name, f"expected {list(shape)}")
        if t.shape != shape:
            raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} from "
                                  "config.json")
        scale = self.stored.get(_scale_name(name))
        if t.dtype in _FLOATS:
            if scale is not None:
                raise CheckpointError(f"{scale.file}: tensor {scale.name} scales {name}, which is stored as {t.dtype}, "
                                      "not FP8")
            return SourceMatrix(t)
        if t.dtype != _FP8:
            raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, expected a float "
                                  f"({', '.join(_FLOATS)}) or F8_E4M3")
        if self.fp8 is None:
            raise CheckpointError(f"{t.file}: tensor {name} is F8_E4M3 but config.json has no FP8 "
                                  "quantization_config")
        if not self.fp8.converted(module):
            raise CheckpointError(f"{t.file}: tensor {name} is F8_E4M3 but config.json lists {module} in "
                                  "quantization_config.modules_to_not_convert")
        if scale is None:
            raise CheckpointError(f"{self.d}: missing tensor {_scale_name(name)} (the FP8 block scales of {name})")
        bm, bn = self.fp8.block
        *lead, rows, cols = shape
        want = (*lead, -(-rows // bm), -(-cols // bn))
        if scale.shape != want or scale.dtype not in _FLOATS:  # float32 here; some Qwen FP8 releases: bf16, f16
            raise CheckpointError(f"{scale.file}: tensor {scale.name} is {scale.dtype}{list(scale.shape)}, expected "
                                  f"a float {list(want)} (blocks of {bm}x{bn} over {list(shape)})")
        self.used.add(scale.name)
        return SourceMatrix(t, scale)

    def plain(self, spec: TensorSpec) -> SourceMatrix:
        name = self.source_name(spec.key)
        conv = spec.key.endswith("conv1d.weight")
        shape = (spec.shape[0], 1, spec.shape[1]) if conv else spec.shape  # HF conv1d: [C, 1, K]
        t = self._get(name, f"expected {list(shape)}")
        if t.shape != shape:
            raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} from "
                                  "config.json")
        if t.dtype not in _FLOATS:
            raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, expected a float "
                                  f"({', '.join(_FLOATS)})")
        return SourceMatrix(t)

    def experts(self, specs: dict[str, TensorSpec], layer: str) -> list[Job]:
        """The routed experts of one layer: fused or one tensor per expert."""
        base = self.source_name(layer) + ".mlp.experts"
        gate, up, down = (specs[f"{layer}.mlp.switch_mlp.{m}"] for m in ("gate_proj", "up_proj", "down_proj"))
        E, I, H = gate.shape
        if base + ".gate_up_proj" in self.stored or base + ".down_proj" in self.stored:
            gate_up = self.matrix(base + ".gate_up_proj", (E, 2 * I, H), base + ".gate_up_proj")
            down_m = self.matrix(base + ".down_proj", (E, H, I), base + ".down_proj")
            return [Job((gate, up), (gate_up,), "split"), Job((down,), (down_m,))]
        jobs = []
        for spec, proj in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")):
            mats = tuple(self.matrix(f"{base}.{e}.{proj}.weight", spec.shape[1:], f"{base}.{e}.{proj}")
                         for e in range(E))
            jobs.append(Job((spec,), mats, "stack"))
        return jobs

    def plan(self) -> list[Job]:
        c = self.config
        mtp = sorted(n for n in self.stored if n.startswith("mtp."))
        if mtp and c.mtp_num_hidden_layers == 0:
            raise CheckpointError(f"{self._file(mtp[0])}: tensor {mtp[0]} belongs to an MTP head, but config.json has "
                                  "no text_config.mtp_num_hidden_layers")
        specs = expected_tensors(c, mtp=bool(mtp))
        jobs: list[Job] = []
        done_experts: set[str] = set()
        for key, spec in specs.items():
            if ".switch_mlp." in key:
                layer = key[:key.index(".mlp.switch_mlp.")]
                if layer not in done_experts:
                    done_experts.add(layer)
                    jobs += self.experts(specs, layer)
            elif spec.quantized:
                module = self.source_name(key)
                jobs.append(Job((spec,), (self.matrix(module + ".weight", spec.shape, module),)))
            else:
                jobs.append(Job((spec,), (self.plain(spec),)))
        unused = sorted(n for n in self.stored if n not in self.used and not _VISION.match(n))
        if unused:
            first = unused[0]
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise CheckpointError(f"{self._file(first)}: unexpected tensor {first}{more}: not part of this model's "
                                  "config")
        return jobs


def plan_original(d: Path, config: ModelConfig, fp8: Fp8Scheme | None) -> list[Job]:
    """Every lily weight of `config` resolved to the stored tensors of an original-layout directory."""
    stored = weight_files(d)
    mlx = next((n for n in stored if n.endswith(".scales")), None)
    if mlx is not None:
        raise CheckpointError(f"{d / 'config.json'}: no MLX 'quantization' block, but the tensors are MLX-quantized "
                              f"({mlx}); lily reads MLX affine 4-bit checkpoints with that block")
    return _Reader(d, config, fp8, stored).plan()
