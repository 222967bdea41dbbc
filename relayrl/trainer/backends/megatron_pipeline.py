"""Pipeline-parallel forward and backward behind one ``logprobs`` call.

The training step computes its loss from per-token log-probs on every rank and calls
``loss.backward()`` there. Across pipeline stages that works as follows:
- forward: stage s receives the hidden states [L, B, H] of stage s-1, runs its layers and sends its
  output to stage s+1; the last stage computes (logprob, entropy) and broadcasts them to every stage
  of its pipeline, so every rank computes the same loss and metrics;
- backward: the last stage's autograd reaches its received input and sends that gradient to stage
  s-1 (a tensor hook); on stage s < last, the outputs are tied to the stage's own output by
  ``FromLastStage``, whose backward receives d loss / d output from stage s+1 and runs the stage's
  backward with it (the gradient the loss gives the broadcast copies is not used: it belongs to the last stage).
The whole batch goes through at once (no micro-batch interleaving); p2p is ``torch.distributed``
send/recv between the global ranks megatron-core's parallel_state names as previous and next.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class FromLastStage(torch.autograd.Function):
    """Forward: the last stage's (logprob, entropy), as received. Backward: the gradient of this stage's
    ``output`` received from the next stage."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, logprob: torch.Tensor, entropy: torch.Tensor, next_rank: int):
        ctx.shape, ctx.dtype, ctx.device, ctx.next_rank = output.shape, output.dtype, output.device, next_rank
        return logprob.clone(), entropy.clone()

    @staticmethod
    def backward(ctx, _grad_logprob, _grad_entropy):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, src=ctx.next_rank)
        return grad, None, None, None


def run_stage(model, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype):
    """This stage's forward on a batch: receives from the previous stage (unless first), sends to the next
    (unless last). Returns the stage output: hidden states [L, B, H], or the last stage's logits."""
    from megatron.core import parallel_state as ps

    batch, length = input_ids.shape
    if not ps.is_pipeline_first_stage():
        received = torch.empty((length, batch, hidden_size), dtype=dtype, device=input_ids.device)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        if torch.is_grad_enabled():
            received.requires_grad_(True)
            prev_rank = ps.get_pipeline_model_parallel_prev_rank()
            received.register_hook(lambda grad: dist.send(grad.contiguous(), dst=prev_rank))
        model.set_input_tensor(received)
    output = model(input_ids, position_ids, None)
    if not ps.is_pipeline_last_stage():
        dist.send(output.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return output


def share_from_last_stage(
    output: torch.Tensor, results: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stage's (logprob, entropy): computed on the last stage (``results``), broadcast to the others,
    where they carry the stage's backward (``FromLastStage``)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return results
    group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_last_rank()
    if ps.is_pipeline_last_stage():
        dist.broadcast(torch.stack([r.detach() for r in results]).contiguous(), src=last, group=group)
        return results
    both = torch.empty((2, *shape), dtype=torch.float32, device=output.device)
    dist.broadcast(both, src=last, group=group)
    if not torch.is_grad_enabled():
        return both[0], both[1]
    return FromLastStage.apply(output, both[0], both[1], ps.get_pipeline_model_parallel_next_rank())
