"""The measuring harness around the vLLM integration: replays of request waves through
vLLM's real scheduler (`replay`), vLLM's manager beside ours (`side_by_side`), the first
diverging step (`lockstep`), encoder-decoder cases (`encdec`) and model cases (`cases`).

It imports the product (`integrations.vllm`), never the reverse.
"""
