"""Where a gradient reaches when only LoRA adapters train, and so which backward collectives run.

With every parameter training, the embedding's output needs a gradient, so every block's input
does and every backward collective runs. Under LoRA (``peft.method=lora``: the base frozen,
adapters on some linear layers) a backward collective runs only where a gradient reaches it.
With the blocks ``0 .. L-1`` of the pattern in order::

    input[i]  = a block before i holds an adapter          its entry's backward (SP: reduce-scatter
                                                            of the norm output's gradient, else all-reduce)
    output[i] = input[i] or block i holds an adapter       its exit's backward (SP: all-gather), its
                                                            recomputation under checkpointing
    mamba[i]  = input[i] or an adapter on its in_proj      its Mamba core's backward: CP exchanges, the
                                                            gated norm's sums (x, B, C, dt, z all come
                                                            from in_proj)
    mlp[i]    = input[i] or an adapter on gate_proj,      its MLP's gradient into the activation (a fused
                up_proj or input_linear                     MLP's slice all-gathered back, Granite)
    branches[i] = input[i], or (Falcon-H1's parallel     both branches of a two-branch layer have an output
                layer) adapters on each of its Mamba and    gradient (Falcon-H1's Mamba and attention,
                attention branches                          Granite's experts and shared MLP): under SP
                                                            the second all-gathers its own
    q[i], k[i], v[i] = input[i] or an adapter on q_proj,   its attention core's gradient exchanges
                k_proj, v_proj                              (allgather: [dK | dV] where k or v; ulysses:
                                                             the gradients of those of q, k, v, and of
                                                             the output where any)

FSDP gathers a unit again in backward where its output's gradient runs, and prefetches the unit
before it there, so unit ``u`` is gathered in backward iff ``output`` holds at the end of unit
``u + 1`` (or of ``u``, the last). A transformers decoder planned through its twin is one unit per
decoder layer (``paired``: two twin blocks). The embedding and every norm are frozen: no SP
all-gather of the embedding's gradient, no all-reduce of a norm weight's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GradFlow", "adapted_linear"]

ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def adapted_linear(name: str) -> str:
    """The adapted linear of a LoRA factor's name (``...q_proj.lora_A``, ``...in_proj.lora_B.weight_z``)."""
    parts = name.split(".")
    return parts[-3] if parts[-2] == "lora_B" else parts[-2]


@dataclass(frozen=True)
class GradFlow:
    """Per block of the pattern: which backward collectives run (module docstring)."""

    input: tuple[bool, ...]
    output: tuple[bool, ...]
    mamba: tuple[bool, ...]
    mlp: tuple[bool, ...]
    branches: tuple[bool, ...]
    q: tuple[bool, ...]
    k: tuple[bool, ...]
    v: tuple[bool, ...]
    base_trains: bool = True  # full training: the embedding, norms and every weight have gradients

    @classmethod
    def full(cls, blocks: int) -> "GradFlow":
        every = (True,) * blocks
        return cls(every, every, every, every, every, every, every, every)

    @classmethod
    def lora(cls, adapted: list[set[str]]) -> "GradFlow":
        """From the adapted linear layers' names (``q_proj``, ``in_proj``, ...) of every block in order."""
        flags: dict[str, list[bool]] = {name: [] for name in ("input", "output", "mamba", "mlp", "branches", "q", "k", "v")}
        before = False
        for names in adapted:
            flags["input"].append(before)
            flags["output"].append(before or bool(names))
            flags["mamba"].append(before or "in_proj" in names)
            flags["mlp"].append(before or bool(names & {"gate_proj", "up_proj", "input_linear"}))
            flags["branches"].append(before or bool(names & {"in_proj", "out_proj"} and names & ATTENTION))
            for name in "qkv":
                flags[name].append(before or f"{name}_proj" in names)
            before = before or bool(names)
        return cls(**{name: tuple(values) for name, values in flags.items()}, base_trains=False)

    @classmethod
    def of_adapters(cls, adapters: dict, blocks: int) -> "GradFlow":
        """From the LoRA factors per unit (``backbone.layers.i``: ``<linear>.lora_A``, ``lora_B``)."""
        return cls.lora([{adapted_linear(p.name) for p in adapters.get(f"backbone.layers.{i}", ())}
                         for i in range(blocks)])

    def recomputed(self, paired: bool) -> tuple[bool, ...]:
        """The blocks a checkpoint recomputes: those a gradient reaches; a decoder layer's (``paired``:
        two blocks, one checkpoint) where its output's does."""
        return tuple(self.output[i | 1] if paired else self.output[i] for i in range(len(self.output)))

    @property
    def kv(self) -> tuple[bool, ...]:
        return tuple(k or v for k, v in zip(self.k, self.v))

    def count(self, flags: tuple[bool, ...], pattern: str, kinds: str | None = None) -> int:
        """Blocks whose ``flags`` hold (of ``kinds`` only, when given)."""
        return sum(1 for flag, kind in zip(flags, pattern) if flag and (kinds is None or kind in kinds))

    def gathered_in_backward(self, unit: int, units: int, paired: bool) -> bool:
        """Whether FSDP gathers block unit ``unit`` (of ``units``) again in backward (module docstring)."""
        last = min(unit + 1, units - 1)
        return self.output[2 * last + 1 if paired else last]
