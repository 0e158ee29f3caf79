"""Load a Hugging Face BLOOM folder, shard it with FSDP2 and save it as a sharded DCP checkpoint
that `./run_train.sh` starts from (weights only: the run begins at step 0 with new optimizer
state). Only rank 0 reads the folder; the others build the model on the meta device and
receive their shards from rank 0, so no other rank ever holds the whole model.

    torchrun --nproc-per-node=2 examples/load_hf_and_shard.py --hf-dir path/to/bloom-560m \\
        --out outputs/560m/checkpoints/step-0
    ./run_train.sh --config configs/bloom-560m.toml --job.dump_folder=outputs/560m \\
        --checkpoint.load_step=0
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from bloomnative.interop import save_native_checkpoint
from bloomnative.model import Bloom
from bloomnative.parallel import apply_fsdp
from bloomnative.train import exit_process


def main() -> None:
    p = argparse.ArgumentParser(description="Shard a Hugging Face BLOOM (module docstring).")
    p.add_argument("--hf-dir", required=True, help="config.json + safetensors")
    p.add_argument("--out", required=True, help="<dump_folder>/checkpoints/step-<N>")
    args = p.parse_args()
    if os.path.exists(args.out):  # never replace a checkpoint
        p.error(f"--out {args.out} exists; choose a new step-<N> folder")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_node_local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # the device of NCCL's object collectives
    rank = dist.get_rank()

    # Rank 0 reads the weights (fp32); the other ranks only need the shape.
    full = Bloom.from_pretrained_hf(args.hf_dir) if rank == 0 else None
    shape = [full.args if rank == 0 else None]
    dist.broadcast_object_list(shape, src=0)
    with torch.device("meta"):
        model = Bloom(shape[0])
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    apply_fsdp(model, mesh["dp"])  # as the training run will: each block its own FSDP unit
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the head its own tensor
    model.init_buffers()  # ALiBi slopes
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if rank == 0 else {}, options=options)

    # The trainer's format: each rank writes its own shards; the folder gets its name only
    # once complete, with the checksum record the trainer verifies before it loads.
    save_native_checkpoint(model, args.out)
    if rank == 0:
        print(f"saved {args.out}, sharded over {mesh.size()} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # not a plain return: see bloomnative.train.exit_process
