"""How the arena's DMA registration reaches cudaHostRegister (kvshare.transfer.hostmem.register_via): through ctypes
on torch's own libcudart, which releases the GIL while a registration runs, else through torch's binding; the
KVSHARE_REGISTER_VIA switch. Without a GPU a stand-in libcudart (compiled here) plays the runtime; with one, the
real runtime registers a tensor that torch's binding then sees as registered (one runtime, not two)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvshare.transfer import hostmem

STAND_IN = r"""
#include <stddef.h>
#include <unistd.h>
static int calls, last_error;
int cudaHostRegister(void *ptr, size_t nbytes, unsigned flags) {
    calls++;
    usleep(300000);                                   /* a registration that takes a while */
    last_error = nbytes == 3 ? 2 : nbytes == 5 ? 712 : last_error;  /* kept, as the runtime keeps it */
    return nbytes == 3 ? 2 : nbytes == 5 ? 712 : 0;   /* 3 bytes: out of memory; 5: already registered */
}
int cudaHostUnregister(void *ptr) { calls++; return 0; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int stand_in_last_error(void) { return last_error; }
int stand_in_calls(void) { return calls; }
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> ctypes.CDLL:
    """A libcudart.so.99 exporting cudaHostRegister/cudaHostUnregister, bound as hostmem binds torch's runtime."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler for the stand-in runtime")
    source, library = tmp_path / "cudart.c", tmp_path / "libcudart.so.99"
    source.write_text(STAND_IN)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    bound = hostmem.bind_cudart(str(library))
    monkeypatch.setattr(hostmem, "_runtime", lambda: bound)
    monkeypatch.setattr(hostmem, "REGISTER_VIA", "ctypes")
    return bound


class TorchBinding:
    """Stands in for torch.cuda.cudart(): records what it was asked."""

    def __init__(self):
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - torch's name
        self.calls.append(("register", ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802 - torch's name
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):  # noqa: N802 - torch's name
        self.calls.append(("get last error",))
        return 0


@pytest.fixture
def binding(monkeypatch) -> TorchBinding:
    fake = TorchBinding()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_runtime_is_found_among_the_mapped_libraries():
    maps = ["7f0000000000-7f0000001000 r--p 00000000 fe:00 1   /usr/lib/libc.so.6",
            "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 ",
            "7f0000004000-7f0000005000 r-xp 00000000 fe:00 2   /site/nvidia/cuda_runtime/lib/libcudart.so.12",
            "7f0000006000-7f0000007000 r-xp 00000000 fe:00 3   /other/libcudart.so.11.0"]
    assert hostmem.cudart_in_maps(maps) == "/site/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert hostmem.cudart_in_maps(maps[:2] + ["7f-7f r--p 0 0:0 0 /lib/libcudart_static_helper.so"]) is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch has a runtime to find")
def test_without_cuda_the_lookup_finds_nothing_and_torch_s_binding_is_chosen():
    """In a fresh process (nothing mapped by other tests): no libcudart, so the default switch falls back."""
    probe = "from kvshare.transfer import hostmem as h; print(h.find_cudart(), h.REGISTER_VIA, h.register_via())"
    env = {name: value for name, value in os.environ.items() if name != "KVSHARE_REGISTER_VIA"}
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           env=env).stdout.split()
    assert found == ["None", "ctypes", "torch"]


def test_the_switch_picks_the_path(stand_in, binding, monkeypatch):
    hostmem.cuda_register(1 << 40, 4096)
    hostmem.cuda_unregister(1 << 40)
    assert stand_in.stand_in_calls() == 2 and binding.calls == []  # ctypes: the runtime, not torch's binding
    monkeypatch.setattr(hostmem, "REGISTER_VIA", "torch")
    hostmem.cuda_register(1 << 40, 4096)
    hostmem.cuda_unregister(1 << 40)
    assert stand_in.stand_in_calls() == 2 and binding.calls == [("register", 1 << 40, 4096), ("unregister", 1 << 40)]
    monkeypatch.setattr(hostmem, "REGISTER_VIA", "cuda-python")
    with pytest.raises(ValueError, match="KVSHARE_REGISTER_VIA='cuda-python'"):
        hostmem.cuda_register(1 << 40, 4096)


def test_without_the_runtime_ctypes_falls_back_to_torch_s_binding(binding, monkeypatch):
    monkeypatch.setattr(hostmem, "_runtime", lambda: None)
    monkeypatch.setattr(hostmem, "REGISTER_VIA", "ctypes")
    assert hostmem.register_via() == "torch"
    hostmem.cuda_register(1 << 40, 8192)
    assert binding.calls == [("register", 1 << 40, 8192)]


def test_errors_raise_and_already_registered_is_fine(stand_in):
    hostmem.cuda_register(1 << 40, 5)  # 712: another part of this process registered it
    assert stand_in.stand_in_last_error() == 0  # cleared: torch's next kernel launch on this thread would raise it
    with pytest.raises(RuntimeError, match="cudaHostRegister of 3 bytes of the arena failed with CUDA error 2"):
        hostmem.cuda_register(1 << 40, 3)


def test_a_registration_through_ctypes_lets_other_threads_run_python(stand_in):
    """While the stand-in's registration sleeps 0.3 s in C, a Python thread keeps counting: the GIL is free. (A PyDLL
    binding, or a binding that holds the GIL, would leave it at ~0.)"""
    done, counted = threading.Event(), []

    def count():
        n = 0
        while not done.is_set():
            n += 1
            time.sleep(0.001)
        counted.append(n)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.02)
    registering = threading.Thread(target=hostmem.cuda_register, args=(1 << 40, 4096))
    t0 = time.perf_counter()
    registering.start()
    while registering.is_alive():  # this thread too: a few GIL round trips per millisecond
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    done.set()
    counter.join()
    assert elapsed >= 0.3 and counted[0] >= 50, (elapsed, counted)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_ctypes_path_registers_in_torch_s_runtime(monkeypatch):
    """The default path on a GPU is ctypes, and what it registers torch's binding reports as already registered; a
    second cuda_register of the same range (712, accepted) leaves no error behind for this thread's next kernel."""
    monkeypatch.setattr(hostmem, "REGISTER_VIA", "ctypes")
    assert hostmem.find_cudart() is not None and hostmem.register_via() == "ctypes"
    host = torch.empty(4 << 20, dtype=torch.uint8)
    hostmem.cuda_register(host.data_ptr(), host.numel())
    try:
        assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 712
        hostmem._clear_last_error()  # that probe's 712 is the test's own
        hostmem.cuda_register(host.data_ptr(), host.numel())  # 712 inside: accepted and cleared
        device = torch.arange(host.numel(), device="cuda", dtype=torch.int32).to(torch.uint8)
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, device.cpu())
    finally:
        hostmem.cuda_unregister(host.data_ptr())
