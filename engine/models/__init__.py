"""Model families, one module each, chosen by a checkpoint's `architectures`
(engine.models.registry); the bundled checkpoint sits beside them in stories260K/."""
