"""Models written once and laid out by placements (``mpipar.models.gpt``)."""
