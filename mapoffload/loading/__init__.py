"""Loading a checkpoint: from files on disk to a module's weights, on the file mapping where it can.

Above ``mapoffload.memory`` (the gate asks it), beside the page cache; imports neither
``pagecache``, ``offload``, ``hf`` nor ``vllm``, which build on it.

- ``files``: a checkpoint's file set (``checkpoint_files``, ``checkpoint_bytes``), the one definition.
- ``header``: a safetensors header read and validated without trusting it.
- ``shard``: a rank's slice of a tensor, a view of the mapping wherever the file allows.
- ``checkpoint``: ``load_checkpoint`` and the gate (``keep_checkpoint_mapped``).
- ``fp8``, ``fp8_workspace``: fp8 weights kept as codes + block scales, dequantized as used; the
  reused CPU buffers they are dequantized into.

``mapoffload.checkpoint`` and ``mapoffload.fp8`` are these modules under their contract and
documented names (``shared/DESIGN.md``, ``docs/usage.md``).
"""
