"""The peers the course is measured against (bench): the same load, other servers.

- hf_peers.py: transformers' own ways (`model.generate`, static batches,
  `generate_batch`), in-process: `make bench PEERS=1`;
- vllm_peer.py: the real vLLM (`make vllm`, `make vllm-serve`), a row of
  `make bench PEERS=vllm`;
- vllm_checks.py: the course against it, two checks: chapter 08's server
  request by request (`make vllm-check`), and the source article's steps
  run for real (`make vllm-steps`);
- llamacpp.py: llama.cpp's `llama-server` (`make llama-server`);
- guidellm_check.py: GuideLLM, vLLM's benchmark tool, beside the load test
  (`make guidellm`).
"""
