"""``p2ptrain.serve.predict``: send samples to a model server, read its answer (stdlib only, no torch:
``model predict`` starts fast)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from p2ptrain.errors import UserError

# A client waits this long for an answer: a batch of MAX_INPUTS_PER_REQUEST samples on a loaded CPU
# takes well under a second; a minute means the server is gone or stuck.
CLIENT_TIMEOUT_S = 60.0
# An answer larger than this is not read (a 1024-sample batch of 1,000 logits is ~20 MB of JSON).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# An error answer is one JSON line with a reason: more is not read.
MAX_ERROR_BYTES = 64 * 1024


class ServeError(UserError):
    """A prediction request failed: the server's reason (4xx/5xx) or why it could not be reached
    (``status`` 0: another server of the model may answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def predict(url: str, inputs: Sequence[Any], timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """POST ``inputs`` (a list of samples) to a server's ``/predict``; its answer
    ``{"outputs": [...], "model_cid": ...}``. :class:`ServeError` with the server's reason otherwise."""
    body = json.dumps({"inputs": list(inputs)}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/predict", data=body,
                                     headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            doc = json.loads(answer.read(MAX_ANSWER_BYTES))
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read(MAX_ERROR_BYTES)).get("error", exc.reason)
        except (ValueError, AttributeError):
            reason = exc.reason
        raise ServeError(f"{url}: {exc.code} {reason}", exc.code) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServeError(f"{url}: {getattr(exc, 'reason', exc)}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("outputs"), list):
        raise ServeError(f"{url}: the answer is not a prediction")
    return doc
