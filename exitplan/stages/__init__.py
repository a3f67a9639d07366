"""One module per DVC stage, each with a ``main(params, ...)`` that reads typed params, calls the library and
writes its outputs atomically. ``dvc.yaml`` runs them as ``exitplan stage <name>``."""
