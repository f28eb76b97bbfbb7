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
 *   remote (slurmstepd), user_init: sets ROTA_GROUP, ROTA_TENANT (the job id: the
 *       same on every rank and node), ROTA_ORCHESTRATOR, ROTA_PRIORITY; task_init sets
 *       ROTA_RANK and ROTA_WORLD_SIZE per task. `rota.connect()` then needs no arguments.
 *   job script (slurmd, end of the job on each node), job_epilog: runs
 *       `ROTA slurm epilog --job ID --group GROUP --orchestrator ADDR`, which calls the
 *       orchestrator's Evict: the job's turn is released and it leaves the queue, also
 *       after scancel or a time limit. A node that dies is covered by the
 *       orchestrator's session TTL.
 *
 * plugstack.conf arguments (written by `rota slurm install-spank`):
 *   orchestrator=ADDR   host:port or unix:PATH given to jobs as ROTA_ORCHESTRATOR
 *   rota=PATH           the `rota` executable used by the epilog (default: rota in PATH)
 *   epilog_timeout=S    seconds the epilog may take (default 20)
 *
 * A group may contain `%n`, replaced by the node name (SLURMD_NODENAME): one group per
 * node, e.g. `--timeslice=gpu-%n`.
 *
 * Options must be registered with spank_option_register() from slurm_spank_init():
 * an exported spank_options table alone is ignored by sbatch/salloc (Slurm 22.05).
 */
#include <errno.h>
#include <limits.h>
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
#define ROTA_ARG_MAX 1024

static char opt_group[ROTA_ID_MAX + 1] = "";
static int have_group = 0;
static long opt_priority = 0;
static int have_priority = 0;
static char arg_orchestrator[ROTA_ARG_MAX] = "";
static char arg_rota[ROTA_ARG_MAX] = "rota";
static int arg_epilog_timeout = 20;

static int opt_group_cb(int val, const char *optarg, int remote);
static int opt_priority_cb(int val, const char *optarg, int remote);

static struct spank_option rota_options[] = {
    {"timeslice", "GROUP",
     "Share GPUs with other jobs of time-slice group GROUP (rota): sets ROTA_GROUP, ROTA_TENANT, "
     "ROTA_ORCHESTRATOR in the job. %n in GROUP is replaced by the node name.",
     1, 0, opt_group_cb},
    {"timeslice-priority", "N",
     "Priority of this job in its time-slice group (integer, higher first under the priority policy).",
     1, 1, opt_priority_cb},
    SPANK_OPTIONS_TABLE_END};

/* Same rule as rota._ids: 1-128 of letters, digits, '.', '_', '-', ':', starting with a
 * letter or digit. `%n` counts as a letter here: it expands to a node name. */
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
        if (c == '%' && g[i + 1] == 'n') {
            i++;
            continue;
        }
        if (i == 0 && !alnum)
            return "must start with a letter or digit";
        if (!alnum && c != '.' && c != '_' && c != '-' && c != ':')
            return "may only contain letters, digits, '.', '_', '-', ':' (and %n for the node name)";
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
    if (errno != 0 || end == s || *end != '\0' || v < -1000000 || v > 1000000)
        return -1;
    *out = v;
    return 0;
}

static int opt_priority_cb(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (parse_priority(optarg, &opt_priority) != 0) {
        slurm_error("rota: --timeslice-priority=%s is not an integer between -1000000 and 1000000",
                    optarg ? optarg : "");
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
    snprintf(arg_rota, sizeof(arg_rota), "%s", "rota");
    arg_epilog_timeout = 20;
    for (i = 0; i < ac; i++) {
        if (strncmp(av[i], "orchestrator=", 13) == 0)
            snprintf(arg_orchestrator, sizeof(arg_orchestrator), "%s", av[i] + 13);
        else if (strncmp(av[i], "rota=", 5) == 0)
            snprintf(arg_rota, sizeof(arg_rota), "%s", av[i] + 5);
        else if (strncmp(av[i], "epilog_timeout=", 15) == 0)
            arg_epilog_timeout = atoi(av[i] + 15) > 0 ? atoi(av[i] + 15) : 20;
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

/* Expand %n to the node name into out; returns 0, or -1 if the result is too long. */
static int expand_group(const char *node, char *out, size_t len)
{
    size_t o = 0;
    const char *p;
    for (p = opt_group; *p; p++) {
        const char *add = NULL;
        char one[2] = {0, 0};
        if (p[0] == '%' && p[1] == 'n') {
            add = node ? node : "";
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
    return (o == 0 || o > ROTA_ID_MAX || (strstr(opt_group, "%n") && !(node && *node))) ? -1 : 0;
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

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    if (!have_group)
        return ESPANK_SUCCESS;
    if (spank_context() == S_CTX_ALLOCATOR || spank_context() == S_CTX_LOCAL) {
        /* Seen by Slurm's Prolog/Epilog scripts as SPANK_ROTA_GROUP (`rota slurm epilog`). */
        spank_job_control_setenv(sp, "ROTA_GROUP", opt_group, 1);
        if (arg_orchestrator[0])
            spank_job_control_setenv(sp, "ROTA_ORCHESTRATOR", arg_orchestrator, 1);
    }
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
    snprintf(buf, sizeof(buf), "%u", job_id);
    spank_setenv(sp, "ROTA_TENANT", buf, 1);
    if (arg_orchestrator[0])
        spank_setenv(sp, "ROTA_ORCHESTRATOR", arg_orchestrator, 1);
    if (have_priority) {
        snprintf(buf, sizeof(buf), "%ld", opt_priority);
        spank_setenv(sp, "ROTA_PRIORITY", buf, 1);
    }
    return ESPANK_SUCCESS;
}

/* Called in each task before exec: the group (SLURMD_NODENAME is known here, for %n),
 * rank and world size. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    uint32_t rank = 0, world = 1;
    char node[256] = "", group[ROTA_ID_MAX + 1], buf[32];
    (void)ac;
    (void)av;
    if (!spank_remote(sp) || !have_group)
        return ESPANK_SUCCESS;
    if (spank_getenv(sp, "SLURMD_NODENAME", node, sizeof(node)) != ESPANK_SUCCESS && getenv("SLURMD_NODENAME"))
        snprintf(node, sizeof(node), "%s", getenv("SLURMD_NODENAME"));
    if (expand_group(node, group, sizeof(group)) != 0) {
        slurm_error("rota: --timeslice=%s gives an invalid group on node '%s'", opt_group, node);
        return -1;
    }
    if (spank_get_item(sp, S_TASK_GLOBAL_ID, &rank) != ESPANK_SUCCESS)
        rank = 0;
    if (spank_get_item(sp, S_JOB_TOTAL_TASK_COUNT, &world) != ESPANK_SUCCESS || world == 0)
        world = 1;
    spank_setenv(sp, "ROTA_GROUP", group, 1);
    snprintf(buf, sizeof(buf), "%u", rank);
    spank_setenv(sp, "ROTA_RANK", buf, 1);
    snprintf(buf, sizeof(buf), "%u", world);
    spank_setenv(sp, "ROTA_WORLD_SIZE", buf, 1);
    return ESPANK_SUCCESS;
}

/* Run `rota slurm epilog ...` with a deadline; never block slurmd for longer. */
static int run_epilog(const char *job, const char *group)
{
    pid_t pid;
    int status = 0, waited_ms = 0;
    char *argv[12];
    int a = 0;
    argv[a++] = arg_rota;
    argv[a++] = "slurm";
    argv[a++] = "epilog";
    argv[a++] = "--job";
    argv[a++] = (char *)job;
    argv[a++] = "--group";
    argv[a++] = (char *)group;
    if (arg_orchestrator[0]) {
        argv[a++] = "--orchestrator";
        argv[a++] = arg_orchestrator;
    }
    argv[a] = NULL;
    pid = fork();
    if (pid < 0) {
        slurm_error("rota: fork for epilog failed: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        int fd = open("/dev/null", O_RDWR);
        if (fd >= 0) {
            dup2(fd, 0);
            dup2(fd, 1);
        }
        setpgid(0, 0);
        execvp(argv[0], argv);
        _exit(127);
    }
    while (waitpid(pid, &status, WNOHANG) == 0) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        if (waited_ms >= arg_epilog_timeout * 1000) {
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            slurm_error("rota: epilog for job %s group %s timed out after %d s", job, group,
                        arg_epilog_timeout);
            return -1;
        }
        nanosleep(&ts, NULL);
        waited_ms += 50;
    }
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
    if (job_id == 0 || expand_group(node, group, sizeof(group)) != 0) {
        slurm_error("rota: epilog cannot tell job or group (job %u, --timeslice=%s)", job_id, opt_group);
        return ESPANK_SUCCESS;
    }
    snprintf(job, sizeof(job), "%u", job_id);
    run_epilog(job, group);
    return ESPANK_SUCCESS; /* never drain a node because the orchestrator was away: TTL covers it */
}
