"""
The operator's entry points: C{tap} (the twistd plugin's options and
service maker, shared by C{kcoral server}) and C{command} (the C{kcoral}
command line).
"""
