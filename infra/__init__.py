"""The Pulumi program's code: components, pure model code, manifests as data (see README, "Repository layout")."""
