"""Entry points that the DDP tests run under torchrun; each reads torchrun's variables like train_gpt2.py does.

    ddp_entry.py train OUT FLAGS...            train, then rank 0 saves the final weights to OUT
    ddp_entry.py fail RANKS STEP FLAGS...      train, with ranks RANKS (1 or 1,2) raising at step STEP
    ddp_entry.py oom RANKS STEP FLAGS...       the same, with the error CUDA raises when memory runs out (a
                                               CPU cannot make it: test_train.raise_out_of_memory)
    ddp_entry.py crash_once OUT RANK STEP FLAGS...  train as `train` does, with rank RANK raising at step STEP
                                               in torchrun's first attempt only (a restart then goes through)
    ddp_entry.py own_folders FOLDER FLAGS...   train, rank N in FOLDER/rank<N>: relative paths in FLAGS name each
                                               rank's own files, as on machines with their own disks
    ddp_entry.py nan_loss RANK STEP FLAGS...   train, with rank RANK's loss turning NaN at step STEP (one
                                               micro-step a step)
    ddp_entry.py hash_routed OUT FLAGS...      train as `train` does, a GPT whose MLPs are mixtures of experts
                                               (conftest.hash_routed_gpt): an expert some batches skip
    ddp_entry.py dropout_masks OUT FLAGS...    train, each rank saving to OUT.rank<N> the embeddings' dropout mask of
                                               each training forward, stacked (forwards, B, T, C)
    ddp_entry.py grad_sync OUT                 train()'s first accumulated step both ways; rank 0 saves both
                                               gradients
    ddp_entry.py card NAME[:BUILD] FLAGS...    train on a machine of 2 of conftest.CARDS[NAME], as torch reports them
                                               (BUILD: a key of conftest.ARCH_LISTS, cu126 unless given; NAME,NAME:
                                               rank 0's card, rank 1's)
    ddp_entry.py leaving COMMAND ARGS...       COMMAND ARGS as above, then prints "rank R exits S, leaving gloo threads
                                               [...]": those still running as Python exits (the group's end ends them)
"""

import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import train_gpt2  # noqa: E402


def train(out, flags):
    result = train_gpt2.main(train_gpt2.parse_args(flags))
    if os.environ.get("RANK", "0") == "0":
        torch.save(result.model.state_dict(), out)


def make_rank_fail(rank, step, error=RuntimeError):
    plain_lr_at = train_gpt2.lr_at

    def lr_at_that_fails(current_step, cfg):
        if current_step == step and os.environ["RANK"] in rank.split(","):
            raise error(f"injected failure on rank {rank} at step {step}")
        return plain_lr_at(current_step, cfg)

    train_gpt2.lr_at = lr_at_that_fails


def fail(rank, step, flags, error=RuntimeError):
    make_rank_fail(rank, step, error)
    train_gpt2.main(train_gpt2.parse_args(flags))


def crash_once(out, rank, step, flags):
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        make_rank_fail(rank, step)
    train(out, flags)


def own_folders(folder, flags):
    os.chdir(Path(folder) / f"rank{os.environ['RANK']}")
    train_gpt2.main(train_gpt2.parse_args(flags))


def nan_loss(rank, step, flags):
    plain_forward = train_gpt2.GPT.forward
    training_forwards = [0]

    def forward_that_diverges_on_one_rank(self, idx, targets=None):
        out = plain_forward(self, idx, targets)  # the logits, or with targets the loss
        if targets is not None and self.training and os.environ["RANK"] == rank:
            training_forwards[0] += 1
            if training_forwards[0] == step + 1:
                return out * float("nan")  # its gradients are NaN too, and DDP averages them into every rank's
        return out

    train_gpt2.GPT.forward = forward_that_diverges_on_one_rank
    train_gpt2.main(train_gpt2.parse_args(flags))


def dropout_masks(out, flags):
    masks, new_model = [], train_gpt2.new_model

    def keep_mask(module, inputs, output):  # (B, T, C): the activations dropout zeroed
        if module.training:
            masks.append((output == 0) & (inputs[0] != 0))

    def new_model_keeping_masks(cfg):
        model = new_model(cfg)
        model.transformer.drop.register_forward_hook(keep_mask)
        return model

    train_gpt2.new_model = new_model_keeping_masks
    train_gpt2.main(train_gpt2.parse_args(flags))
    torch.save(torch.stack(masks), f"{out}.rank{os.environ['RANK']}")


def idle_parameter(flags):
    """A parameter forward never uses: DDP would wait for its gradient, or raise at the next step."""
    class WithAnIdleGain(train_gpt2.GPT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.transformer.h[0].attn.value_gain = torch.nn.Parameter(torch.ones(()))

    train_gpt2.GPT = WithAnIdleGain
    train_gpt2.main(train_gpt2.parse_args(flags))


def grad_sync(out):
    """train()'s first step, its micro-steps inline: the gradients after them, as all_reduce_mean (called once a step,
    right after the micro-steps) sees them, with DDP synced in the last micro-step only (no_sync in the others) and
    in every one (no_sync a no-op)."""
    from conftest import TINY_ARGS

    launch = train_gpt2.launch_from_env(os.environ)
    train_gpt2.init_distributed(launch, "cpu")
    # 4 micro-steps x 2 ranks x 2 windows of 16 + 1 tokens a step, in order
    flags = TINY_ARGS + ["--block_size", "16", "--seq_len", "16", "--micro_batch_size", "2", "--total_batch_size",
                         "256", "--max_steps", "1", "--warmup_steps", "1", "--ckpt_every", "0"]
    gradients, models = [], []
    new_model, all_reduce_mean = train_gpt2.new_model, train_gpt2.all_reduce_mean

    def new_model_seen(cfg):
        models.append(new_model(cfg))  # train()'s plain model, inside its DDP wrapper
        return models[-1]

    def all_reduce_mean_after_the_micro_steps(value, launch):
        gradients.append({n: p.grad.clone() for n, p in models.pop().named_parameters()})
        return all_reduce_mean(value, launch)

    train_gpt2.new_model = new_model_seen
    train_gpt2.all_reduce_mean = all_reduce_mean_after_the_micro_steps
    no_sync = DDP.no_sync
    for sync_last_only in (True, False):
        DDP.no_sync = no_sync if sync_last_only else lambda self: contextlib.nullcontext()
        cfg, _ = train_gpt2.device_settings(train_gpt2.parse_args(
            flags + ["--log_dir", str(Path(out).parent / f"log_{sync_last_only}")]), launch)
        # it frees its DDP model when it returns: the reducer holds the process group and, freed after
        # destroy_process_group, would destroy the group itself, which joins gloo's threads while holding the GIL that
        # one of them may be waiting for (PyTorch #56297): this launch once hung so
        train_gpt2.train(cfg)  # the recipe's Run (train() reads the launch from torchrun's variables)
    DDP.no_sync = no_sync
    assert len(gradients) == 2, len(gradients)
    if launch.rank == 0:
        torch.save(gradients, out)
    dist.destroy_process_group()


def card(name, flags):
    from conftest import report_card

    card_name, _, build = name.partition(":")  # v100:cu130: a V100 under torch's CUDA 13.0 build
    cards = card_name.split(",")  # a100,t4: rank 0's machine holds A100s, rank 1's T4s
    report_card(cards[int(os.environ["RANK"]) % len(cards)], setattr, gpus=2, build=build or "cu126")
    train_gpt2.main(train_gpt2.parse_args(flags))


def leaving(command, args):
    """What a rank leaves to Python's exit: a gloo thread that frees a tensor then aborts the process (PyTorch
    #179291). Linux names each thread in /proc."""
    try:
        run(command, args)
        status = 0
    except SystemExit as stop:
        status = stop.code
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    print(f"rank {os.environ['RANK']} exits {status}, leaving gloo threads {sorted(n for n in names if 'gloo' in n)}",
          flush=True)
    sys.exit(status)


def run(command, args):
    if command == "train":
        train(args[0], args[1:])
    elif command == "fail":
        fail(args[0], int(args[1]), args[2:])
    elif command == "crash_once":
        crash_once(args[0], args[1], int(args[2]), args[3:])
    elif command == "oom":
        fail(args[0], int(args[1]), args[2:], error=torch.OutOfMemoryError)
    elif command == "own_folders":
        own_folders(args[0], args[1:])
    elif command == "nan_loss":
        nan_loss(args[0], int(args[1]), args[2:])
    elif command == "dropout_masks":
        dropout_masks(args[0], args[1:])
    elif command == "idle_parameter":
        idle_parameter(args)
    elif command == "hash_routed":
        from conftest import hash_routed_gpt

        train_gpt2.GPT = hash_routed_gpt()
        train(args[0], args[1:])
    elif command == "card":
        card(args[0], args[1:])
    elif command == "leaving":
        leaving(args[0], args[1:])
    else:
        grad_sync(args[0])


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
