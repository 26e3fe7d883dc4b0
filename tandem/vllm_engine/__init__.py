"""vLLM as a worker's engine (``--engine vllm``): ``AsyncLLM`` in the worker's process, its state reported as
Tandem's own engine reports it. Importing it needs vLLM installed (``tandem[vllm]``)."""
