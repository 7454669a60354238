"""The end-to-end harness's report on a driver that stopped answering (vllm_harness.Background.state): its threads'
stacks while it runs, its exit status and log once it has exited. A stand-in driver: no vLLM needed."""

import time

from vllm_harness import Background

DRIVER = """
import time

from vllm_harness import dump_stacks_on_request


def waiting_for_the_test():
    print("READY", flush=True)
    while True:
        time.sleep(0.05)


dump_stacks_on_request()
waiting_for_the_test()
"""


def test_state_shows_a_running_drivers_stacks_then_its_exit(tmp_path):
    driver = tmp_path / "stand_in_driver.py"
    driver.write_text(DRIVER)
    bg = Background(driver, [], tmp_path / "driver.log")
    try:
        deadline = time.monotonic() + 60
        while "READY" not in bg.log():
            assert bg.proc.poll() is None and time.monotonic() < deadline, bg.log()
            time.sleep(0.05)
        running = bg.state()
        assert running.startswith(f"running (pid {bg.proc.pid})"), running
        assert "waiting_for_the_test" in running and "stand_in_driver.py" in running, running
        assert bg.proc.poll() is None, "the stack dump ended the driver"
    finally:
        bg.stop()
    exited = bg.state()
    assert exited.startswith("exited (rc=-9)") and "READY" in exited, exited
