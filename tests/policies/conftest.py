"""The policy tests run thousands of tiny tensor ops, so every one of them runs on one intra-op thread.

A fixture, not a module-level call: conftest files are imported at collection, so a bare
``torch.set_num_threads(1)`` here would also hold for every engine test in the session (it made the
2k-token passkey test run on one core, 567 s instead of about 290 s)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def policy_tests_on_one_thread(one_intra_op_thread: None) -> None:
    """Applies tests/conftest.py's one_intra_op_thread to every module in tests/policies."""
