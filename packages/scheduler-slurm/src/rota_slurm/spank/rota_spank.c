/*
 * rota SPANK plugin: `sbatch|srun|salloc --timeslice=GROUP [--timeslice-priority=N]`.
 *
 * Why a SPANK plugin: it is the one place where Slurm lets a site add submit options
 * that are validated at submit time and turned into environment variables inside the
 * job, on every node and every rank, without the user writing any wrapper script.
 *
 * What it does, by context:
 *   allocator (sbatch/salloc) and local (srun): validates the options (a bad value
 *       fails the submission with the message below) and records the group in the
 *       job-control environment (SPANK_ROTA_GROUP), which Slurm's Prolog/Epilog see.
 *   remote (slurmstepd), init_post_opt (still root): with auth_key= in plugstack.conf,
 *       issues the step's token, for this job and its group on this node, valid for the
 *       job's time left (`PYTHON -I -m rota_slurm._token`, which reads the root-only key),
 *       and sets it as ROTA_TOKEN: the job acts for itself and for no other job.
 *       user_init: sets ROTA_TENANT (the job id: the same on every rank and node),
 *       ROTA_ORCHESTRATOR, ROTA_TLS_CA, ROTA_PRIORITY, and notes the step's GPUs;
 *       task_init sets ROTA_GROUP per task and, in a step of several tasks, ROTA_RANK
 *       (SLURM_PROCID) and ROTA_WORLD_SIZE (SLURM_NTASKS). A step of one task (the
 *       batch script, `srun -n1`) gets neither: its one process may start several
 *       ranks itself (torchrun), whose ranks rota.connect() then takes from
 *       torch.distributed. `rota.connect()` needs no arguments.
 *   job script (slurmd, end of the job on each node), job_epilog: runs
 *       `ROTA slurm epilog --job ID --group GROUP --orchestrator ADDR [--auth-key KEY]`,
 *       which calls the orchestrator's Evict with an admin token made from KEY: the
 *       job's turn is released and it leaves the queue, also after scancel or a time
 *       limit. A node that dies is covered by the orchestrator's session TTL.
 *       The orchestrator comes from plugstack.conf only: the epilog runs as root with
 *       the job-control environment, which the submitting user controls (SPANK_*), so
 *       without orchestrator= it evicts nothing and says why. Helpers run with a fixed
 *       environment (PATH, SLURM_CONF, SLURMD_NODENAME, ROTA_TLS_CA), never the job's.
 *
 * plugstack.conf arguments (written by `rota slurm install-spank`):
 *   orchestrator=ADDR   host:port or unix:PATH given to jobs as ROTA_ORCHESTRATOR
 *   rota=PATH           the `rota` executable used by the epilog (default: rota in PATH)
 *   python=PATH         the Python that has rota installed (issues tokens; needed with auth_key=)
 *   auth_key=PATH       the orchestrator's auth key (root only, mode 0600): jobs get ROTA_TOKEN,
 *                       the epilog an admin token
 *   tls_ca=PATH         the orchestrator's TLS CA: jobs and the epilog get ROTA_TLS_CA
 *   epilog_timeout=S    seconds the epilog, or the token issuer, may take (default 20)
 *   max_priority=N      the highest --timeslice-priority a job's token may carry (0..1000, default 0):
 *                       the orchestrator refuses a priority above its token's; a job asking more
 *                       than N gets no token and its step fails, saying so
 *
 * A group may contain `%n`, replaced by the node name (SLURMD_NODENAME): one group per
 * node, e.g. `--timeslice=gpu-%n`; and `%g`, replaced by the set of GPUs the step's
 * GRES (shards or whole GPUs) sit on, sorted: `gpu0` for GPU 0, `gpu0_1` for GPUs 0 and
 * 1 (read from SLURM_STEP_GPUS, else SLURM_JOB_GPUS: Slurm's global GPU indices, which
 * stay right when ConstrainDevices renumbers CUDA_VISIBLE_DEVICES). `--timeslice=%n-%g`
 * is one group per GPU set of a node: jobs on the same GPUs take turns, a job on other
 * GPUs (or on a different set that overlaps) is in another group. The set is read once
 * per step (user_init), so every task of a node gets the same group even when Slurm
 * binds each task to one of the GPUs. Both are per node, so a step whose tasks span
 * several nodes must name a fixed group (all its ranks must be in one group); the
 * plugin refuses to start such a step otherwise.
 *
 * Options must be registered with spank_option_register() from slurm_spank_init():
 * an exported spank_options table alone is ignored by sbatch/salloc (Slurm 22.05).
 */
#define _GNU_SOURCE /* execvpe */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <slurm/spank.h>

SPANK_PLUGIN(rota, 1);

#define ROTA_ID_MAX 128
#ifndef SLURM_BATCH_SCRIPT
#define SLURM_BATCH_SCRIPT (0xfffffffb) /* step id of the batch script, as in slurm/slurm.h */
#endif
#define ROTA_ARG_MAX 1024

/* The orchestrator's priority range (rota.config MIN_PRIORITY/MAX_PRIORITY): `rota slurm install-spank`
 * compiles them in with -D, so sbatch refuses what the orchestrator would refuse when the job runs. */
#ifndef ROTA_MIN_PRIORITY
#define ROTA_MIN_PRIORITY -1000
#endif
#ifndef ROTA_MAX_PRIORITY
#define ROTA_MAX_PRIORITY 1000
#endif

#define ROTA_STR_(x) #x
#define ROTA_STR(x) ROTA_STR_(x)

static char opt_group[ROTA_ID_MAX + 1] = "";
static int have_group = 0;
static long opt_priority = 0;
static int have_priority = 0;
static char arg_orchestrator[ROTA_ARG_MAX] = "";
static char arg_rota[ROTA_ARG_MAX] = "rota";
static char arg_python[ROTA_ARG_MAX] = "";
static char arg_auth_key[ROTA_ARG_MAX] = "";
static char arg_tls_ca[ROTA_ARG_MAX] = "";
static int arg_epilog_timeout = 20;
static long arg_max_priority = 0;
static char step_gpus[ROTA_ID_MAX + 1] = ""; /* `gpu0_1`: this node's GPUs of the step, for %g */
static char step_gpus_why[160] = "";         /* why step_gpus is empty */

static int opt_group_cb(int val, const char *optarg, int remote);
static int opt_priority_cb(int val, const char *optarg, int remote);

#include "rota_spank_submit.c" /* warn_at_submit: a job that asks no GPU, told at sbatch */

static struct spank_option rota_options[] = {
    {"timeslice", "GROUP",
     "Share GPUs with other jobs of time-slice group GROUP (rota): sets ROTA_GROUP, ROTA_TENANT, "
     "ROTA_ORCHESTRATOR in the job. In GROUP, %n is replaced by the node name and %g by the job's "
     "GPUs on it (gpu0, gpu0_1, ...): --timeslice=%n-%g is one group per GPU set.",
     1, 0, opt_group_cb},
    {"timeslice-priority", "N",
     "Priority of this job in its time-slice group (an integer from " ROTA_STR(ROTA_MIN_PRIORITY) " to "
     ROTA_STR(ROTA_MAX_PRIORITY) ", higher first under the priority policy).",
     1, 1, opt_priority_cb},
    SPANK_OPTIONS_TABLE_END};

/* Same rule as rota._ids: 1-128 of letters, digits, '.', '_', '-', ':', starting with a
 * letter or digit. `%n` and `%g` count as a letter here: they expand to a node name and
 * to `gpu<i>[_<j>...]`. */
static const char *check_group(const char *g)
{
    size_t i, n;
    if (g == NULL || *g == '\0')
        return "is empty; give a group name such as --timeslice=g0";
    n = strlen(g);
    if (n > ROTA_ID_MAX)
        return "is longer than 128 characters";
    for (i = 0; i < n; i++) {
        char c = g[i];
        int alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (c == '%' && (g[i + 1] == 'n' || g[i + 1] == 'g')) {
            i++;
            continue;
        }
        if (i == 0 && !alnum)
            return "must start with a letter or digit";
        if (!alnum && c != '.' && c != '_' && c != '-' && c != ':')
            return "may only contain letters, digits, '.', '_', '-', ':' (and %n for the node name, %g for "
                   "the job's GPUs)";
    }
    return NULL;
}

static int opt_group_cb(int val, const char *optarg, int remote)
{
    const char *why = check_group(optarg);
    (void)val;
    (void)remote;
    if (why != NULL) {
        slurm_error("rota: --timeslice=%s %s", optarg ? optarg : "", why);
        return ESPANK_BAD_ARG;
    }
    snprintf(opt_group, sizeof(opt_group), "%s", optarg);
    have_group = 1;
    return ESPANK_SUCCESS;
}

static int parse_priority(const char *s, long *out)
{
    char *end = NULL;
    long v;
    if (s == NULL || *s == '\0')
        return -1;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < ROTA_MIN_PRIORITY || v > ROTA_MAX_PRIORITY)
        return -1;
    *out = v;
    return 0;
}

static int opt_priority_cb(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (parse_priority(optarg, &opt_priority) != 0) {
        slurm_error("rota: --timeslice-priority=%s is not an integer between %d and %d (the orchestrator's range)",
                    optarg ? optarg : "", ROTA_MIN_PRIORITY, ROTA_MAX_PRIORITY);
        return ESPANK_BAD_ARG;
    }
    have_priority = 1;
    return ESPANK_SUCCESS;
}

/* Every callback gets the plugstack.conf arguments; not every context calls init first
 * (the job epilog runs in its own process), so each callback parses them. */
static void parse_args(int ac, char **av)
{
    int i;
    arg_orchestrator[0] = '\0';
    arg_python[0] = '\0';
    arg_auth_key[0] = '\0';
    arg_tls_ca[0] = '\0';
    snprintf(arg_rota, sizeof(arg_rota), "%s", "rota");
    arg_epilog_timeout = 20;
    arg_max_priority = 0;
    for (i = 0; i < ac; i++) {
        if (strncmp(av[i], "orchestrator=", 13) == 0)
            snprintf(arg_orchestrator, sizeof(arg_orchestrator), "%s", av[i] + 13);
        else if (strncmp(av[i], "rota=", 5) == 0)
            snprintf(arg_rota, sizeof(arg_rota), "%s", av[i] + 5);
        else if (strncmp(av[i], "python=", 7) == 0)
            snprintf(arg_python, sizeof(arg_python), "%s", av[i] + 7);
        else if (strncmp(av[i], "auth_key=", 9) == 0)
            snprintf(arg_auth_key, sizeof(arg_auth_key), "%s", av[i] + 9);
        else if (strncmp(av[i], "tls_ca=", 7) == 0)
            snprintf(arg_tls_ca, sizeof(arg_tls_ca), "%s", av[i] + 7);
        else if (strncmp(av[i], "epilog_timeout=", 15) == 0)
            arg_epilog_timeout = atoi(av[i] + 15) > 0 ? atoi(av[i] + 15) : 20;
        else if (strncmp(av[i], "max_priority=", 13) == 0 && parse_priority(av[i] + 13, &arg_max_priority) == 0)
            arg_max_priority = arg_max_priority < 0 ? 0 : arg_max_priority;
        else if (spank_context() == S_CTX_SLURMD)
            slurm_error("rota: unknown plugstack.conf argument '%s' (ignored)", av[i]);
    }
}

/* Options are known in the callbacks on the submitting side; on the remote side and in
 * the epilog they are read back from the job with spank_option_getopt. */
static void load_options(spank_t sp)
{
    char *arg = NULL;
    if (!have_group && spank_option_getopt(sp, &rota_options[0], &arg) == ESPANK_SUCCESS && arg
        && check_group(arg) == NULL) {
        snprintf(opt_group, sizeof(opt_group), "%s", arg);
        have_group = 1;
    }
    arg = NULL;
    if (!have_priority && spank_option_getopt(sp, &rota_options[1], &arg) == ESPANK_SUCCESS && arg
        && parse_priority(arg, &opt_priority) == 0)
        have_priority = 1;
}

#define ROTA_MAX_GPU 1024

/* Turn Slurm's GPU index list ("1,0", "0-3", "2") into the sorted set name "gpu0_1",
 * "gpu0_1_2_3", "gpu2". Returns 0, or -1 if the list is empty, unreadable (e.g.
 * "NoDevFiles") or the name does not fit in len. */
static int gpu_set_name(const char *list, char *out, size_t len)
{
    static unsigned char seen[ROTA_MAX_GPU];
    const char *p = list;
    size_t o;
    int i, any = 0;
    if (list == NULL || *list == '\0' || len < 5)
        return -1;
    memset(seen, 0, sizeof(seen));
    while (*p) {
        char *end = NULL;
        long lo, hi;
        if (*p < '0' || *p > '9')
            return -1;
        errno = 0;
        lo = strtol(p, &end, 10);
        hi = lo;
        if (errno != 0 || end == p)
            return -1;
        p = end;
        if (*p == '-') {
            p++;
            if (*p < '0' || *p > '9')
                return -1;
            hi = strtol(p, &end, 10);
            if (errno != 0 || end == p)
                return -1;
            p = end;
        }
        if (lo < 0 || hi < lo || hi >= ROTA_MAX_GPU)
            return -1;
        for (i = (int)lo; i <= (int)hi; i++)
            seen[i] = 1;
        any = 1;
        if (*p == ',')
            p++;
        else if (*p != '\0')
            return -1;
    }
    if (!any)
        return -1;
    o = (size_t)snprintf(out, len, "gpu");
    for (i = 0; i < ROTA_MAX_GPU; i++) {
        int n;
        if (!seen[i])
            continue;
        n = snprintf(out + o, len - o, o == 3 ? "%d" : "_%d", i);
        if (n < 0 || (size_t)n >= len - o)
            return -1;
        o += (size_t)n;
    }
    return 0;
}

/* Note this node's GPUs of the step (for %g), from the step's environment: Slurm's
 * global indices, SLURM_STEP_GPUS for a step with GRES, else SLURM_JOB_GPUS (the batch
 * step, or a step that inherited the job's). Read once per step, before the tasks
 * fork, so every task of the node expands %g alike. */
static void load_step_gpus(spank_t sp)
{
    char list[4096];
    const char *names[] = {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS"};
    size_t i;
    step_gpus[0] = '\0';
    snprintf(step_gpus_why, sizeof(step_gpus_why), "%s", "SLURM_STEP_GPUS and SLURM_JOB_GPUS are unset");
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (spank_getenv(sp, names[i], list, sizeof(list)) != ESPANK_SUCCESS || list[0] == '\0')
            continue;
        if (gpu_set_name(list, step_gpus, sizeof(step_gpus)) != 0) {
            step_gpus[0] = '\0';
            snprintf(step_gpus_why, sizeof(step_gpus_why), "%s=%.100s is not a list of GPU indices", names[i],
                     list);
        }
        return;
    }
}

/* Expand %n to the node name and %g to the GPU set into out; returns 0, or -1 if a
 * placeholder has no value or the result is too long. */
static int expand_group(const char *node, const char *gpus, char *out, size_t len)
{
    size_t o = 0;
    const char *p;
    for (p = opt_group; *p; p++) {
        const char *add = NULL;
        char one[2] = {0, 0};
        if (p[0] == '%' && p[1] == 'n') {
            add = node ? node : "";
            p++;
        } else if (p[0] == '%' && p[1] == 'g') {
            add = gpus ? gpus : "";
            p++;
        } else {
            one[0] = *p;
            add = one;
        }
        if (o + strlen(add) >= len)
            return -1;
        memcpy(out + o, add, strlen(add));
        o += strlen(add);
    }
    out[o] = '\0';
    if (o == 0 || o > ROTA_ID_MAX)
        return -1;
    if ((strstr(opt_group, "%n") && !(node && *node)) || (strstr(opt_group, "%g") && !(gpus && *gpus)))
        return -1;
    return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    int i;
    parse_args(ac, av);
    for (i = 0; rota_options[i].name != NULL; i++) {
        if (spank_option_register(sp, &rota_options[i]) != ESPANK_SUCCESS) {
            slurm_error("rota: could not register --%s", rota_options[i].name);
            return -1;
        }
    }
    return ESPANK_SUCCESS;
}

/* The group of this step on this node: GROUP with %n and %g expanded. Returns NULL, or
 * why there is none (the step spans several nodes with %n/%g, has no GPUs for %g, or the
 * name is invalid) for the caller to report. node gets the node name. */
static const char *step_group(spank_t sp, int batch, char *node, size_t nlen, char *group, size_t glen)
{
    static char why[512];
    uint32_t nodes = 1;
    node[0] = '\0';
    if (spank_getenv(sp, "SLURMD_NODENAME", node, (int)nlen) != ESPANK_SUCCESS && getenv("SLURMD_NODENAME"))
        snprintf(node, nlen, "%s", getenv("SLURMD_NODENAME"));
    /* The batch script is one process on one node, whatever the job's -n and -N. */
    if (!batch && (spank_get_item(sp, S_JOB_NNODES, &nodes) != ESPANK_SUCCESS || nodes == 0))
        nodes = 1;
    if (nodes > 1 && (strstr(opt_group, "%n") || strstr(opt_group, "%g"))) {
        snprintf(why, sizeof(why), "rota: --timeslice=%s names one node's group, but this step runs on %u nodes and "
                 "all its ranks must share one group: give a group without %%n/%%g (e.g. --timeslice=g0)",
                 opt_group, nodes);
        return why;
    }
    if (strstr(opt_group, "%g") && step_gpus[0] == '\0') {
        snprintf(why, sizeof(why), "rota: --timeslice=%s uses %%g, but the step has no GPUs on node '%s' (%s): ask "
                 "for GPUs with --gres=shard:N or --gres=gpu:N, or give a group without %%g",
                 opt_group, node, step_gpus_why);
        return why;
    }
    if (expand_group(node, step_gpus, group, glen) != 0) {
        snprintf(why, sizeof(why), "rota: --timeslice=%s gives an invalid group on node '%s'", opt_group, node);
        return why;
    }
    return NULL;
}

static int is_batch_step(spank_t sp)
{
    uint32_t step = 0;
    return spank_get_item(sp, S_JOB_STEPID, &step) == ESPANK_SUCCESS && step == SLURM_BATCH_SCRIPT;
}

/* Run argv (argv[0] looked up in PATH) as a helper: stdin from /dev/null, in "/", with a
 * fixed environment: never the job's or the submitting user's, which may name another
 * orchestrator or Python modules. Its stdout goes to out (up to len - 1 bytes,
 * NUL-terminated) or, without out, to /dev/null; its stderr to the caller's. Killed after
 * arg_epilog_timeout seconds. Returns the wait status, or -1. */
static int run_helper(char *const argv[], char *out, size_t len)
{
    static char env_conf[PATH_MAX + 16], env_node[300], env_ca[ROTA_ARG_MAX + 16];
    char *envp[6];
    int e = 0, status = 0, waited_ms = 0, pipefd[2] = {-1, -1};
    size_t got = 0;
    pid_t pid;
    envp[e++] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    if (getenv("SLURM_CONF")) {
        snprintf(env_conf, sizeof(env_conf), "SLURM_CONF=%s", getenv("SLURM_CONF"));
        envp[e++] = env_conf;
    }
    if (getenv("SLURMD_NODENAME")) {
        snprintf(env_node, sizeof(env_node), "SLURMD_NODENAME=%s", getenv("SLURMD_NODENAME"));
        envp[e++] = env_node;
    }
    if (arg_tls_ca[0]) {
        snprintf(env_ca, sizeof(env_ca), "ROTA_TLS_CA=%s", arg_tls_ca);
        envp[e++] = env_ca;
    }
    envp[e] = NULL;
    if (out != NULL && pipe(pipefd) != 0)
        return -1;
    pid = fork();
    if (pid < 0) {
        slurm_error("rota: fork for %s failed: %s", argv[0], strerror(errno));
        if (out != NULL) {
            close(pipefd[0]);
            close(pipefd[1]);
        }
        return -1;
    }
    if (pid == 0) {
        int fd = open("/dev/null", O_RDWR);
        if (fd >= 0)
            dup2(fd, 0);
        if (out != NULL) {
            dup2(pipefd[1], 1);
            close(pipefd[0]);
        } else if (fd >= 0) {
            dup2(fd, 1);
        }
        setpgid(0, 0);
        if (chdir("/") != 0)
            _exit(126);
        execvpe(argv[0], argv, envp);
        _exit(127);
    }
    if (out != NULL) {
        close(pipefd[1]);
        out[0] = '\0';
    }
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (waited_ms >= arg_epilog_timeout * 1000) {
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            if (out != NULL)
                close(pipefd[0]);
            slurm_error("rota: `%s` timed out after %d s (epilog_timeout= in plugstack.conf)", argv[0],
                        arg_epilog_timeout);
            return -1;
        }
        if (out != NULL && pipefd[0] >= 0) {
            struct pollfd p = {pipefd[0], POLLIN, 0};
            if (poll(&p, 1, 50) > 0) {
                char sink[256];
                int room = got + 1 < len;
                ssize_t n = room ? read(pipefd[0], out + got, len - 1 - got) : read(pipefd[0], sink, sizeof(sink));
                if (n > 0 && room) {
                    got += (size_t)n;
                    out[got] = '\0';
                } else if (n == 0) {
                    close(pipefd[0]);
                    pipefd[0] = -1;
                }
            }
        } else {
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        waited_ms += 50;
    }
    if (out != NULL && pipefd[0] >= 0) { /* what it wrote just before it exited */
        ssize_t n;
        while (got + 1 < len && (n = read(pipefd[0], out + got, len - 1 - got)) > 0)
            got += (size_t)n;
        out[got] = '\0';
        close(pipefd[0]);
    }
    return status;
}

/* The step's token: `PYTHON -I -m rota_slurm._token --auth-key KEY --group G --job J`
 * (the key is root's; this runs before privileges are dropped), into ROTA_TOKEN. A
 * step whose group cannot be named gets none: task_init refuses it with the reason. */
static int issue_token(spank_t sp)
{
    uint32_t job_id = 0;
    char node[256], group[ROTA_ID_MAX + 1], job[32], prio[32], out[4200];
    char *argv[14];
    const char *why;
    size_t i, n;
    int a = 0, status;
    if (!arg_auth_key[0])
        return ESPANK_SUCCESS;
    if (!arg_python[0]) {
        slurm_error("rota: plugstack.conf has auth_key= but no python=: add python=PATH (the Python rota is "
                    "installed in; `rota slurm install-spank --auth-key` writes both)");
        return -1;
    }
    if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
        slurm_error("rota: cannot read the job id");
        return -1;
    }
    if (strstr(opt_group, "%g"))
        load_step_gpus(sp);
    why = step_group(sp, is_batch_step(sp), node, sizeof(node), group, sizeof(group));
    if (why != NULL)
        return ESPANK_SUCCESS;
    snprintf(job, sizeof(job), "%u", job_id);
    argv[a++] = arg_python;
    argv[a++] = "-I";
    argv[a++] = "-m";
    argv[a++] = "rota_slurm._token";
    argv[a++] = "--auth-key";
    argv[a++] = arg_auth_key;
    argv[a++] = "--group";
    argv[a++] = group;
    argv[a++] = "--job";
    argv[a++] = job;
    if (have_priority && opt_priority > 0) { /* the token allows what the job asked, if the node allows that */
        if (opt_priority > arg_max_priority) {
            slurm_error("rota: job %s asks --timeslice-priority=%ld, above max_priority=%ld of plugstack.conf (the "
                        "highest priority a job's token may carry): ask for at most %ld, or ask an admin to raise "
                        "it (rota slurm install-spank --max-priority N)", job, opt_priority, arg_max_priority,
                        arg_max_priority);
            return -1;
        }
        snprintf(prio, sizeof(prio), "%ld", opt_priority);
        argv[a++] = "--max-priority";
        argv[a++] = prio;
    }
    argv[a] = NULL;
    status = run_helper(argv, out, sizeof(out));
    n = strlen(out);
    while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r'))
        out[--n] = '\0';
    for (i = 0; i < n && status == 0; i++) /* a JWT: base64url parts joined by dots, nothing else */
        if (!((out[i] >= 'a' && out[i] <= 'z') || (out[i] >= 'A' && out[i] <= 'Z') || (out[i] >= '0' && out[i] <= '9')
              || out[i] == '-' || out[i] == '_' || out[i] == '.'))
            status = -2;
    if (status != 0 || n == 0) {
        slurm_error("rota: could not issue job %s's token for group %s (status %d): %.300s", job, group, status,
                    status == -2 ? "the issuer printed more than a token" : out);
        return -1;
    }
    spank_setenv(sp, "ROTA_TOKEN", out, 1);
    return ESPANK_SUCCESS;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    if (spank_context() == S_CTX_REMOTE) {
        load_options(sp);
        return have_group ? issue_token(sp) : ESPANK_SUCCESS;
    }
    if (!have_group)
        return ESPANK_SUCCESS;
    if (spank_context() == S_CTX_ALLOCATOR || spank_context() == S_CTX_LOCAL) {
        /* Seen by Slurm's Prolog/Epilog scripts as SPANK_ROTA_GROUP (`rota slurm epilog`). The
         * orchestrator is not passed this way: the submitting user controls this environment. */
        spank_job_control_setenv(sp, "ROTA_GROUP", opt_group, 1);
    }
    if (spank_context() == S_CTX_ALLOCATOR)
        warn_at_submit();
    return ESPANK_SUCCESS;
}

/* Called in slurmstepd before the tasks start: job-wide variables. */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
    uint32_t job_id = 0;
    char buf[64];
    parse_args(ac, av);
    if (!spank_remote(sp))
        return ESPANK_SUCCESS;
    load_options(sp);
    if (!have_group)
        return ESPANK_SUCCESS;
    if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
        slurm_error("rota: cannot read the job id");
        return -1;
    }
    if (strstr(opt_group, "%g"))
        load_step_gpus(sp);
    snprintf(buf, sizeof(buf), "%u", job_id);
    spank_setenv(sp, "ROTA_TENANT", buf, 1);
    if (arg_orchestrator[0])
        spank_setenv(sp, "ROTA_ORCHESTRATOR", arg_orchestrator, 1);
    if (arg_tls_ca[0])
        spank_setenv(sp, "ROTA_TLS_CA", arg_tls_ca, 1);
    if (have_priority) {
        snprintf(buf, sizeof(buf), "%ld", opt_priority);
        spank_setenv(sp, "ROTA_PRIORITY", buf, 1);
    }
    return ESPANK_SUCCESS;
}

/* True when Slurm gave the step a GPU or a shard of one: it then sets one of these. */
static int step_has_gpus(spank_t sp)
{
    char value[64];
    const char *names[] = {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"};
    size_t i;
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (spank_getenv(sp, names[i], value, sizeof(value)) == ESPANK_SUCCESS && value[0] != '\0')
            return 1;
    return 0;
}

/* Called in each task before exec: the group (SLURMD_NODENAME is known here, for %n;
 * the step's GPUs were noted in user_init, for %g), rank and world size. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    uint32_t rank = 0, world = 1;
    char node[256], group[ROTA_ID_MAX + 1], buf[32];
    const char *why;
    int batch;
    (void)ac;
    (void)av;
    if (!spank_remote(sp) || !have_group)
        return ESPANK_SUCCESS;
    batch = is_batch_step(sp);
    if (!batch) {
        if (spank_get_item(sp, S_TASK_GLOBAL_ID, &rank) != ESPANK_SUCCESS)
            rank = 0;
        if (spank_get_item(sp, S_JOB_TOTAL_TASK_COUNT, &world) != ESPANK_SUCCESS || world == 0)
            world = 1;
    }
    why = step_group(sp, batch, node, sizeof(node), group, sizeof(group));
    if (why != NULL) {
        slurm_error("%s", why);
        return -1;
    }
    spank_setenv(sp, "ROTA_GROUP", group, 1);
    if (rank == 0 && !step_has_gpus(sp)) /* the task's stderr is the job's by now: the user reads it there */
        fprintf(stderr, "rota: warning: --timeslice=%s without a GPU request: Slurm gave this step no GPU (no "
                "CUDA_VISIBLE_DEVICES), so it sees none, or, on a node without ConstrainDevices, every GPU outside "
                "Slurm's allocation; submit with --gres=shard:1 (a share of one GPU) or --gres=gpu:N\n", opt_group);
    if (world > 1) {
        snprintf(buf, sizeof(buf), "%u", rank);
        spank_setenv(sp, "ROTA_RANK", buf, 1);
        snprintf(buf, sizeof(buf), "%u", world);
        spank_setenv(sp, "ROTA_WORLD_SIZE", buf, 1);
    } else { /* not inherited from the submitting shell or the batch script either */
        spank_unsetenv(sp, "ROTA_RANK");
        spank_unsetenv(sp, "ROTA_WORLD_SIZE");
    }
    return ESPANK_SUCCESS;
}

/* Run `rota slurm epilog ...` with a deadline; never block slurmd for longer. */
static int run_epilog(const char *job, const char *group)
{
    int status, a = 0;
    char *argv[14];
    argv[a++] = arg_rota;
    argv[a++] = "slurm";
    argv[a++] = "epilog";
    argv[a++] = "--job";
    argv[a++] = (char *)job;
    argv[a++] = "--group";
    argv[a++] = (char *)group;
    argv[a++] = "--orchestrator";
    argv[a++] = arg_orchestrator;
    if (arg_auth_key[0]) {
        argv[a++] = "--auth-key";
        argv[a++] = arg_auth_key;
    }
    argv[a] = NULL;
    status = run_helper(argv, NULL, 0);
    if (status == -1)
        return -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        slurm_error("rota: `%s slurm epilog --job %s --group %s` failed (status %d)", arg_rota, job,
                    group, status);
        return -1;
    }
    slurm_info("rota: job %s left time-slice group %s", job, group);
    return 0;
}

int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
    uint32_t job_id = 0;
    const char *node = getenv("SLURMD_NODENAME");
    char group[ROTA_ID_MAX + 1], job[32];
    parse_args(ac, av);
    load_options(sp);
    if (!have_group)
        return ESPANK_SUCCESS;
    if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
        const char *env = getenv("SLURM_JOB_ID");
        job_id = env ? (uint32_t)strtoul(env, NULL, 10) : 0;
    }
    if (!arg_orchestrator[0]) {
        /* The job-control environment (SPANK_ROTA_ORCHESTRATOR...) comes from the submitting
         * user: root's Evict, and its admin token, must not go where it says. */
        slurm_info("rota: job %u: no orchestrator= in plugstack.conf, so its epilog evicts nothing (the job's own "
                   "environment is not trusted to name one); its turn ends with its session or the orchestrator's "
                   "TTL", job_id);
        return ESPANK_SUCCESS;
    }
    if (job_id != 0 && strstr(opt_group, "%g")) {
        /* Each step had the group of its own GPUs: `rota slurm epilog` evicts the job from
         * every group of this node that matches GROUP. */
        snprintf(group, sizeof(group), "%s", opt_group);
    } else if (job_id == 0 || expand_group(node, "", group, sizeof(group)) != 0) {
        slurm_error("rota: epilog cannot tell job or group (job %u, --timeslice=%s)", job_id, opt_group);
        return ESPANK_SUCCESS;
    }
    snprintf(job, sizeof(job), "%u", job_id);
    run_epilog(job, group);
    return ESPANK_SUCCESS; /* never drain a node because the orchestrator was away: TTL covers it */
}
