"""A GPU engine's host threads (`specserve/executor/host_threads.py`): one torch thread unless chosen."""

import pytest
import torch

from specserve.executor import host_threads
from specserve.executor.host_threads import ENV, host_threads_wanted, settle_host_threads


def test_one_thread_unless_the_operator_chose():
    assert host_threads_wanted({}) == 1
    assert host_threads_wanted({"OMP_NUM_THREADS": "4"}) is None  # Ray's workers, or the operator's
    assert host_threads_wanted({ENV: "3", "OMP_NUM_THREADS": "4"}) == 3


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5", ""])
def test_a_bad_count_names_the_variable(raw):
    with pytest.raises(ValueError, match=ENV):
        host_threads_wanted({ENV: raw})


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_gpu_engine_sets_them_and_a_cpu_engine_keeps_its_own(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(ENV, "2")
    assert settle_host_threads(torch.device("cpu")) == threads  # the model computes on them
    assert settle_host_threads(torch.device("cuda")) == 2
    monkeypatch.delenv(ENV)
    assert settle_host_threads(torch.device("cuda", 0)) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(threads)
    assert settle_host_threads(torch.device("cuda")) == threads
    assert host_threads.ENV == "SPECSERVE_HOST_THREADS"
