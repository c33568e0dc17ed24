"""The offline hidden-state cache, in one place: the frozen target runs once over the data, its states
are stored, and heads then train from them (`data.hidden_states=offline`) without the decoder layers.

    layout.py   the on-disk format: shard plan, atomic safetensors shards, progress files, index.json
    build.py    building it (resumable, distributed): scripts/cache_hidden_states.py
    match.py    what a cache was built for, and the one-line refusal when a run differs; its rows
    batches.py  reading it as training data: token rows + a collator adding the stored states
    target.py   the stand-in target: embedding and lm_head only, states taken from the batch
"""
