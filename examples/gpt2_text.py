"""A GPT-2-architecture language model (a small config of transformers' GPT-2) trained across peers
on text files from disk.

The model comes from the installed ``transformers`` by config, the way a task's ``[model] name =
"hf"`` builds it (``p2ptrain.models.build_model``: no weights or code from the Hub); the text is read
from a folder of files (``--texts``, default: a few of Python's own modules) by the reader ``dataset
add text:PATH`` uses, cut into windows of token ids (bytes here; ``dataset add --tokenizer`` takes a
tokenizer.json), and each member trains on every n-th window. Needs ``pip install 'p2ptrain[hf]'``.
Run one copy per member (see examples/_common.py)::

    python examples/gpt2_text.py --texts 'corpus/*.txt' --member 0 --members 2 --listen /ip4/127.0.0.1/tcp/4001
    python examples/gpt2_text.py --texts 'corpus/*.txt' --member 1 --members 2 --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<its id>

Its last line names the run's model CID. The run's card is a user's module (the Optimizer is given
an instance), so ``p2ptrain.load_model(CID)`` says it has no builder for it: load it into the same
architecture with ``p2ptrain.load_state(build_model("hf", CONFIG, seed=0), CID)``.

The same model as a task that any peer joins (after ``p2ptrain dataset add 'text:DIR' --context 64``)::

    [model]
    name = "hf"
    config = { model_type = "gpt2", n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 256, n_positions = 64,
               bos_token_id = 0, eos_token_id = 0 }
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from _common import parse_args, run_member, weights_digest
from torch import nn

import p2ptrain
from p2ptrain.data import SourceOptions, read_source
from p2ptrain.models import build_model

CONTEXT = 64
CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": CONTEXT,
          "bos_token_id": 0, "eos_token_id": 0}
# Text files every machine has: the sources of Python's json package.
TEXTS = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")


def windows(texts: str, member: int, members: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """This member's windows of the text files (every members-th), and a held-out tenth shared by all."""
    source = read_source(f"text:{texts}", SourceOptions(context=CONTEXT))
    x, y = torch.from_numpy(source.features.astype("int64")), torch.from_numpy(source.labels.astype("int64"))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # the same split on every machine
    x, y = x[order], y[order]
    cut = len(x) // 10
    mine = slice(member, None, members)
    return torch.utils.data.TensorDataset(x[cut:][mine], y[cut:][mine]), torch.utils.data.TensorDataset(x[:cut], y[:cut])


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_out_loss(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        return float(lm_loss(model, *data.tensors))


def main() -> None:
    args = parse_args(__doc__, steps=60, run="gpt2-text", extra=[("--texts", {
        "default": TEXTS, "help": "a text file, a folder of them or a glob (the same on every member; default: "
        "the sources of Python's json package)"})])
    train_data, test_data = windows(args.texts, args.member, args.members)
    model = build_model("hf", CONFIG, seed=0)  # the same initial weights on every member
    first = held_out_loss(model, test_data)
    torch.manual_seed(args.member)  # dropout and batch order: each member's own
    loader = torch.utils.data.DataLoader(train_data, batch_size=16, shuffle=True, drop_last=True)
    opt = p2ptrain.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), model=model,
                             run=args.run, home=args.home, listen=[args.listen],
                             bootstrap=args.bootstrap, density=0.1, checkpoint_every=20,
                             min_peers=min(2, args.members), max_peers=args.members, total_steps=args.steps,
                             evaluate=lambda m: {"loss": held_out_loss(m, test_data)})
    print(f"member {args.member} of run {opt.run_cid} at {opt.addresses[0]}", flush=True)
    with opt:
        try:
            while True:
                model.train()
                for x, y in loader:
                    opt.zero_grad()
                    loss = lm_loss(model, x, y)
                    loss.backward()
                    opt.step(loss=loss)
        except p2ptrain.RunFinished:
            pass
        print(json.dumps({"member": args.member, "model_cid": opt.model_cid, "run_cid": opt.run_cid,
                          "steps": opt.step_count, "first_loss": first, "loss": held_out_loss(model, test_data),
                          "weights": weights_digest(model)}), flush=True)


if __name__ == "__main__":
    run_member(main)
