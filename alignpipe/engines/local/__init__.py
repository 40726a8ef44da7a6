"""The local engine, built on TRL and transformers: ``stages/`` holds one entry module per stage
(``run(ctx)``); the modules beside it are what those stages share."""
