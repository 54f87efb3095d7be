"""The CustomResourceDefinitions (this folder is their single source), installed as package data
(``flatcake.crd_files``) so that ``operator render`` and ``operator check`` find them in any install."""
