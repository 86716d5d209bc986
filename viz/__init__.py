"""The visual debugger: a Streamlit app over pure renderers of plans and timelines.

    streamlit run viz/app.py                          # the built-in sample plan, simulated on the spot
    streamlit run viz/app.py -- plan.json [timeline.json]
    mpipar viz plan.json [timeline.json]              # the same, bound to 127.0.0.1
    python -m viz plan.json                           # what ``mpipar viz`` runs

Every figure is drawn by a pure function in this package (matplotlib ``Figure`` objects built
without pyplot, text grids for terminals); ``viz/app.py`` only wires state, selection and
downloads. Modules: ``files`` (reading uploads and CLI files, readable errors, never pickle),
``planinfo`` (plan queries shared by the views), ``layout``, ``propagation``, ``stepper``,
``comm``, ``pipeline``, ``memory``, ``whatif`` (one per view), ``sample`` (the built-in plan).
"""
