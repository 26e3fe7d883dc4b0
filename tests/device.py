"""The torch device the engine tests and the tests' gpu_worker use: TANDEM_TEST_DEVICE=cuda on a GPU machine."""

import os

TEST_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
