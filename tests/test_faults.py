"""A peer that dies mid-step makes the other ranks fail with a message, within the process group's
timeout, instead of hanging."""
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, time, datetime, torch, torch.distributed as dist, torch.multiprocessing as mp

    def main(rank, world, init):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        import burstc
        from burstc.testing import zoo
        from torch.distributed.device_mesh import init_device_mesh
        cmodel = burstc.compile(zoo.titan_llama(), init_device_mesh("cpu", (world,)), backend="aot_eager")
        tokens, labels = zoo.titan_inputs()
        cmodel(tokens, labels).backward()          # one good step on both ranks
        dist.barrier()
        if rank == 1:
            os._exit(3)                            # the peer dies
        t0 = time.time()
        try:
            for _ in range(5):
                cmodel(tokens, labels).backward()
        except Exception as e:
            print(f"RANK0_ERROR after {time.time() - t0:.1f}s: {type(e).__name__}: {str(e)[:300]}", flush=True)
            os._exit(1)
        print("RANK0_NO_ERROR", flush=True)
        os._exit(0)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=main, args=(r, 2, "tcp://127.0.0.1:" + sys.argv[1])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
""")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multirank  # spawns two gloo ranks of its own
def test_dead_peer_fails_the_others_with_a_message(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(SCRIPT)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True,
                          text=True, timeout=240)
    elapsed = time.time() - t0
    out = proc.stdout + proc.stderr
    print([l for l in out.splitlines() if "RANK0" in l])
    assert "RANK0_NO_ERROR" not in out
    assert "RANK0_ERROR" in out, out[-3000:]
    line = next(l for l in out.splitlines() if "RANK0_ERROR" in l)
    waited = float(line.split("after ")[1].split("s:")[0])
    assert waited < 60, line   # the 20 s process-group timeout plus slack: no hang
    assert elapsed < 240
