"""Fuzz targets of the resync path: the chain a head names (JSON lines of signed records) and the
optimizer state a member resumes from (safetensors whose tensor names carry parameter indexes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from _p2ptrain_fuzzing import FuzzTarget
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.run import RunDir
from p2ptrain.run._feedback_file import load_feedback
from p2ptrain.protocol import Chain, RecordError, sign_record, tensors_bytes
from p2ptrain.task import load_task
from p2ptrain.training import Trainer
from p2ptrain.wire import ModelRecord

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
INITIAL = "QmPZ9gcCEpqKTo6aq61g2nXGUhM4iCL3ewB6LDXZCtioEB"
KEY = create_new_key_pair()


def _chain(n: int) -> bytes:
    chain, parent = Chain(CID, INITIAL), INITIAL
    for v in range(1, n + 1):
        model = f"Qm{'abcdefghijk'[v]}" + INITIAL[3:]
        chain.append(sign_record(ModelRecord(
            task_cid=CID, version=v, parent=parent, round=3 * v, step=3 * v, members=("a", "b"),
            metrics={"loss": 0.5}, model_cid=model, optimizer_cid=CID, term=v, coordinator=""), KEY))
        parent = model
    return chain.to_bytes()


TASK = load_task(f"""
name = "t"
seed = 1
[model]
name = "mlp"
kwargs = {{ in_features = 4, hidden = [3], out_features = 2 }}
[dataset]
manifest = "{CID}"
[optimizer]
name = "adam"
lr = 0.01
[training]
batch_size = 2
total_steps = 10
""")
_TRAINER = Trainer(TASK, device="cpu")
_TRAINER.apply(torch.zeros(_TRAINER.num_parameters))
MODEL = _TRAINER.model_bytes()
OPTIMIZER = _TRAINER.optimizer_bytes()


def _load_optimizer(data: bytes) -> None:
    _TRAINER.load_state(MODEL, data)


_RUN_DIR = RunDir(Path(tempfile.mkdtemp(prefix="p2ptrain-fuzz-run-")))
_FEEDBACK_SEED = tensors_bytes({"residual": torch.arange(_TRAINER.num_parameters, dtype=torch.float32)})


def _load_feedback(data: bytes) -> None:
    """A member's kept error feedback (disk input, run/_feedback_file.py): any bytes give a
    residual of the model's size or None, never an error."""
    _RUN_DIR.feedback(7).write_bytes(data)
    residual = load_feedback(_RUN_DIR, 7, _TRAINER.num_parameters)
    assert residual is None or tuple(residual.shape) == (_TRAINER.num_parameters,)


TARGETS = [
    FuzzTarget("resync.chain", lambda data: Chain.from_bytes(CID, INITIAL, data), (RecordError,), [_chain(1), _chain(2)]),
    FuzzTarget("resync.optimizer_state", _load_optimizer, (RecordError,), [OPTIMIZER]),
    FuzzTarget("resync.feedback_file", _load_feedback, (), [_FEEDBACK_SEED]),
]
