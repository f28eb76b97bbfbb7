/*
 * Part of rota_spank.c (included by it): the submit-time check that a --timeslice job asks
 * Slurm for a GPU. sbatch and salloc give a SPANK plugin no access to the job's GRES, so
 * this reads what the user gave them: the command line (/proc/self/cmdline), the
 * SBATCH_/SALLOC_ variables that stand for those options, and the #SBATCH lines at the top
 * of the batch script. A job without any GPU request is warned about on the submitting
 * terminal, before it queues (it still runs, and its output gets the same warning from
 * task_init, where Slurm's own view of the step is known).
 */

#define ROTA_CMDLINE_MAX 65536

/* A GRES/TRES value that names a GPU or a shard of one (gpu:1, shard:2, gres/gpu=1, ...). */
static int names_gpu(const char *value)
{
    return value != NULL && (strstr(value, "gpu") != NULL || strstr(value, "shard") != NULL);
}

/* Does the option `arg` (its value inline after '=', or in `next`) ask for a GPU? */
static int option_asks_gpu(const char *arg, const char *next)
{
    static const char *counts[] = {"--gpus", "--gpus-per-node", "--gpus-per-task", "--gpus-per-socket", "-G"};
    static const char *tres[] = {"--gres", "--tres-per-task", "--tres-per-node"};
    size_t i, n;
    if (strncmp(arg, "-G", 2) == 0 && arg[2] != '\0' && arg[1] != '-')
        return 1; /* -G2 */
    for (i = 0; i < sizeof(counts) / sizeof(counts[0]); i++)
        if (strcmp(arg, counts[i]) == 0 || (strncmp(arg, counts[i], strlen(counts[i])) == 0
                                            && arg[strlen(counts[i])] == '='))
            return 1;
    for (i = 0; i < sizeof(tres) / sizeof(tres[0]); i++) {
        n = strlen(tres[i]);
        if (strncmp(arg, tres[i], n) != 0)
            continue;
        if (arg[n] == '=')
            return names_gpu(arg + n + 1);
        if (arg[n] == '\0')
            return names_gpu(next);
    }
    return 0;
}

/* Does `path` start with "#!"? */
static int is_script(const char *path)
{
    char head[2] = {0, 0};
    FILE *f = fopen(path, "r");
    size_t got = 0;
    if (f != NULL) {
        got = fread(head, 1, 2, f);
        fclose(f);
    }
    return got == 2 && head[0] == '#' && head[1] == '!';
}

/* The #SBATCH lines at the top of `path`, if it is a script (starts with "#!"). */
static int script_asks_gpu(const char *path)
{
    char line[4096], *tok, *toks[128], *save = NULL;
    int n, i, first = 1, found = 0;
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        if (first && strncmp(line, "#!", 2) != 0)
            break;
        first = 0;
        if (line[0] != '#' && line[strspn(line, " \t\r\n")] != '\0')
            break; /* sbatch stops reading options at the first command */
        if (strncmp(line, "#SBATCH", 7) != 0)
            continue;
        n = 0;
        for (tok = strtok_r(line + 7, " \t\r\n", &save); tok != NULL && n < 128; tok = strtok_r(NULL, " \t\r\n", &save))
            toks[n++] = tok;
        for (i = 0; i < n && !found; i++)
            found = option_asks_gpu(toks[i], i + 1 < n ? toks[i + 1] : NULL);
    }
    fclose(f);
    return found;
}

/* 1 when the submit asks for a GPU, 0 when it does not, -1 when that cannot be told. */
static int submit_asks_gpu(void)
{
    static const char *counts[] = {"SBATCH_GPUS", "SBATCH_GPUS_PER_NODE", "SBATCH_GPUS_PER_TASK",
                                   "SBATCH_GPUS_PER_SOCKET", "SALLOC_GPUS", "SALLOC_GPUS_PER_NODE",
                                   "SALLOC_GPUS_PER_TASK", "SALLOC_GPUS_PER_SOCKET"};
    static const char *tres[] = {"SBATCH_GRES", "SBATCH_TRES_PER_TASK", "SALLOC_GRES", "SALLOC_TRES_PER_TASK"};
    static char buf[ROTA_CMDLINE_MAX];
    char *argv[1024];
    const char *v;
    ssize_t len = 0, got;
    int fd, argc = 0, i, script = 0;
    size_t k;
    for (k = 0; k < sizeof(counts) / sizeof(counts[0]); k++)
        if ((v = getenv(counts[k])) != NULL && *v != '\0')
            return 1;
    for (k = 0; k < sizeof(tres) / sizeof(tres[0]); k++)
        if (names_gpu(getenv(tres[k])))
            return 1;
    fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    while (len < (ssize_t)sizeof(buf) - 1 && (got = read(fd, buf + len, sizeof(buf) - 1 - (size_t)len)) > 0)
        len += got;
    close(fd);
    if (len <= 0 || len >= (ssize_t)sizeof(buf) - 1)
        return -1; /* unreadable, or too long to be sure of */
    buf[len] = '\0';
    for (i = 0; i < len && argc < 1024; i += (int)strlen(buf + i) + 1)
        argv[argc++] = buf + i;
    for (i = 1; i < argc; i++)
        if (option_asks_gpu(argv[i], i + 1 < argc ? argv[i + 1] : NULL))
            return 1;
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--wrap") == 0 || strncmp(argv[i], "--wrap=", 7) == 0)
            script = 1; /* no #SBATCH lines */
        else if (argv[i][0] != '-' && access(argv[i], R_OK) == 0) { /* the batch script: a file starting with #! */
            if (script_asks_gpu(argv[i]))
                return 1;
            script = script || is_script(argv[i]);
        }
    }
    return script || strstr(argv[0], "salloc") != NULL ? 0 : -1; /* a script on stdin cannot be read here */
}

/* In sbatch/salloc, after the options: warn on the submitting terminal about a job without a GPU. */
static void warn_at_submit(void)
{
    if (submit_asks_gpu() != 0)
        return;
    fprintf(stderr, "rota: warning: --timeslice=%s without a GPU request: Slurm will give the job no GPU (no "
            "CUDA_VISIBLE_DEVICES), so it sees none, or, on a node without ConstrainDevices, every GPU outside "
            "Slurm's allocation; submit with --gres=shard:1 (a share of one GPU) or --gres=gpu:N\n", opt_group);
}
