"""Writing checkpoints: one save path for every rank and for one process.

    options      SaveOptions (every knob and its default, once) and the private test Seams
    describe     step 1: flatten a rank's state into what it holds (RankState + local pieces)
    sharing      tied weights and views of one buffer: aliases and storage spans
    agreement    step 2: one fixed-size all-reduce agrees on step, destination, replicated values
    plan         step 4: the write plan (each distinct box written once) and typed WriteItems
    messages     the typed messages ranks exchange, encoded with the manifest's record codecs
    coordinator  LocalCoordinator (no collectives) | GroupCoordinator (gloo control group)
    protocol     run_save: steps 2-8 on any coordinator
    shard_file   one data file: header up front, hashed while written (threads, O_DIRECT)
    writer       CheckpointWriter: files of any number of ranks from one process, one commit
    stager       reusable (pinned) host buffers for snapshots
    async_save   async_save and its handle: snapshot on the call, save in the background
"""
