"""A training worker: group set-up, the schedule executor, migration and the generation
loop. Its entry point is :func:`chameleon_ft.runtime.worker.process.worker_main`."""
