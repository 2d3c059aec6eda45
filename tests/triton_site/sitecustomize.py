"""Put on PYTHONPATH by tests/conftest.py for the Model Runner V2 pass of the suite: every Python process
the tests start (servers, their API-server and engine-core processes, multiprocess executors) runs V2's
Triton kernels in Triton's interpreter, as the test process does (``vllm_evict.testing``)."""

import os

if os.environ.get("VLLM_EVICT_TRITON_INTERPRETER") == "1":
    from vllm_evict.testing import use_triton_interpreter_backend

    use_triton_interpreter_backend()
