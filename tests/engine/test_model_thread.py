"""engine.model_thread.ModelThread: build and every call on one thread, errors re-raised."""

import threading

import pytest
import torch

from engine.model_thread import ModelThread


def test_builds_and_runs_every_call_on_its_own_thread():
    names = []

    def build():
        names.append(threading.current_thread().name)
        return torch.nn.Linear(4, 2)

    worker = ModelThread(build, "model-x")
    x = torch.ones(3, 4)

    def forward(inp):
        names.append(threading.current_thread().name)
        return worker.built(inp)
    callers = [threading.Thread(target=worker.call, args=(forward, x)) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    out = worker.call(forward, x)
    assert torch.equal(out, worker.built(x))
    assert names == ["model-x"] * 6  # build + 4 threads' calls + this one
    assert worker.call(lambda: worker.call(lambda: 7)) == 7  # nested call runs in place
    worker.close()


def test_errors_of_build_and_calls_reach_the_caller():
    with pytest.raises(ValueError, match="no weights"):
        ModelThread(lambda: (_ for _ in ()).throw(ValueError("no weights")), "bad")
    worker = ModelThread(lambda: None, "ok")
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    assert worker.call(lambda a, b: a + b, 2, 3) == 5  # still serving after an error
    worker.close()
