"""Loading a checkpoint: from files on disk to a module's weights, left on the file mapping where it can.

Above ``mapoffload.memory`` (the gate asks it), beside the page cache; imports neither
``pagecache``, ``offload``, ``hf`` nor ``vllm``, which build on it.

- ``files``: a checkpoint's file set (``checkpoint_files``, ``checkpoint_bytes``), the one definition;
  ``CheckpointError``.
- ``header``: a safetensors header read and validated without trusting it.
- ``read``: every tensor of a file set as mapped CPU views; a key in two files refused.
- ``checkpoint``: ``load_checkpoint`` (validate everything, then assign), with the names below.
- ``gate``: ``keep_checkpoint_mapped`` (copies or the mapping) and ``match_checkpoint_dtypes``.
- ``empty``: ``empty_weights``, building a module with its parameters on meta.
- ``slots``: where each state-dict name lives in a module, and its tie groups.
- ``report``: ``LoadReport``, what a load did.
- ``shard``: a rank's slice of a tensor, a view of the mapping wherever the file allows.
- ``fp8``, ``fp8_workspace``: fp8 weights kept as codes + block scales, dequantized as used; the
  reused CPU buffers they are dequantized into.
- ``load_plan``, ``decide``, ``assign``: ``load_checkpoint``'s three steps (what goes where, checked;
  the mapping or copies, decided once; the tensors put in place and accounted); ``reasons``:
  ``CopyReason``, the one type of the reasons a load's bytes were copied.
"""
