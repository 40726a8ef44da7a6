"""The local engine's stage entry modules, one per stage and named for it: ``alignpipe.stage``
loads ``stages.<stage>`` by name and calls its ``run(ctx)`` (and ``plan``/``needs_image`` where
it has them)."""
