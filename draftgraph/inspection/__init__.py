"""Graph inspection (`draftgraph inspect`) and its semantic diff (`draftgraph graph-diff`)."""
