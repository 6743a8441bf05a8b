"""The commands that read finished results and answer from them: advise, plan, project, trace, and the levers,
the A/B and the stand-in table advise composes; above the components, which never import them."""
