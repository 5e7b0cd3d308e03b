"""The DeepSpeed format's convert target: a ZeRO checkpoint of a training state.

convert (convert/to_zero.py) lays a training state out as DeepSpeed's config asks (tensors,
model- and optim-states templates, param groups) and hands it over as the protocol's
`ZeroStateTarget`; here it becomes what the ZeRO writer writes from (a `ZeroInfo`, the files named
under the step's tag) and is written like a resharded ZeRO checkpoint (writer.write_zero_files).
What no writer can lay out from a state (expert groups) is refused first.
"""

from __future__ import annotations

from ...context import RunContext
from ...storage.commit import Output
from ..protocols import ZeroStateTarget
from .files import ZeroFiles
from .info import ZeroGroup, ZeroInfo
from .names import step_tag
from .refusals import refuse_experts
from .writer import DEFAULT_SUB_GROUP_SIZE, write_zero_files


def write_state(target: ZeroStateTarget, out: Output, ctx: RunContext) -> list[str]:
    """The tag's model- and optim-states files (and `latest`) of the training state in `target`."""
    refuse_experts(target.source_index)  # a MoE source's experts need expert groups: not laid out yet
    tag = step_tag(target.step)
    files = ZeroFiles(
        tag=tag,
        prefix=f"{tag}/",
        model_files={0: "model"},
        optim_files={0: "optim"},
        bf16_prefix=target.precision == "bfloat16",
    )
    info = ZeroInfo(
        stage=target.stage,
        world_size=target.world_size,
        files=files,
        groups=[
            ZeroGroup(index=g, param_group=g, params=group.params, paddings=group.paddings)
            for g, group in enumerate(target.groups)
        ],
        frozen=dict(target.frozen),
        buffers=list(target.buffers),
        shared=dict(target.shared),
        model_states={0: target.model_template},
        optim_states={0: target.optim_template},
        archives={},
        param_group_count=len(target.groups),
        dtype=target.precision,
    )
    sub_group_size = target.zero_config.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    return write_zero_files(
        out,
        target.index,
        target.source,
        info,
        target.world_size,
        tag,
        int(sub_group_size) if sub_group_size is not None else None,
        ctx=ctx,
    )
