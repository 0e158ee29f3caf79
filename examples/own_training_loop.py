"""Train BLOOM in your own loop with bloomnative's parts: the model built on the meta device, a
2-D (dp x tp) mesh, tensor parallelism and FSDP2 from `bloomnative.parallel`, the blended
datasets and stateful loader of `bloomnative.data`, AdamW and the project's gradient clipping.
With matching settings it computes the losses `./run_train.sh` logs (tests/test_examples.py checks).

    torchrun --nproc-per-node=4 examples/own_training_loop.py --tp 2 --steps 20 \\
        --data 0.7 assets/pydocs/pydocs_text_document 0.3 my/corpus_text_document
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from bloomnative.data import PretrainingLoader, build_gpt_datasets
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel import apply_fsdp, apply_tensor_parallel, clip_grad_norm_, init_weights
from bloomnative.train import exit_process


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train BLOOM in your own loop (module docstring).")
    p.add_argument("--data", nargs="+", default=["assets/pydocs/pydocs_text_document"])
    p.add_argument("--model", default="debug", help="preset[,field=value...]: debug,n_layer=2")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = world / tp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3, help="peak; decays to lr / 10")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def lr_factor(step: int, args: argparse.Namespace) -> float:  # Megatron's, to lr / 10 at the end
    if step < args.warmup_steps:
        return step / args.warmup_steps
    ratio = (step - args.warmup_steps) / max(args.steps - args.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio))


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_node_local_rank()) if cuda else torch.device("cpu")
    dp = dist.get_world_size() // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    # Built on the meta device and parallelised; then each rank allocates only its shards.
    preset, *fields = args.model.split(",")
    overrides = {k: int(v) for k, v in (field.split("=") for field in fields)}
    with torch.device("meta"):
        model = Bloom(BloomArgs.from_preset(preset, **overrides))
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    apply_fsdp(model, mesh["dp"], param_dtype=torch.float32)  # torch.bfloat16: mixed precision
    model.to_empty(device=device)
    init_weights(model, seed=args.seed)  # the same weights under any layout

    # Each dp rank reads its slice of every global batch; loader.state_dict() resumes.
    samples = (args.steps * args.global_batch_size, 0, 0)
    train, _, _ = build_gpt_datasets(args.data, "1,0,0", args.seq_len, args.seed, samples)
    loader = PretrainingLoader(train, args.micro_batch_size, dp_rank, dp, device)

    params = list(model.parameters())  # no weight decay on biases and LayerNorm weights (1-D)
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args))

    tokens = args.global_batch_size * args.seq_len  # of the global batch, over all dp ranks
    for step in range(1, args.steps + 1):
        step_loss = torch.zeros((), device=device)
        with loss_parallel():  # the logits stay sharded over the vocabulary
            for inputs, labels in loader.next_batch(args.global_batch_size):
                logits = model(inputs).flatten(0, 1).float()
                loss = F.cross_entropy(logits, labels.flatten(), reduction="sum") / tokens
                loss.backward()  # FSDP sums the gradients over the dp ranks: the global mean's
                step_loss += loss.detach().full_tensor()
        grad_norm = clip_grad_norm_(params, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        dist.all_reduce(step_loss, group=mesh["dp"].get_group())  # sum of the ranks' shares
        if dist.get_rank() == 0:
            print(f"step {step} | loss {step_loss.item():.8f} | grad_norm {grad_norm.item():.8f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # not a plain return: see bloomnative.train.exit_process
