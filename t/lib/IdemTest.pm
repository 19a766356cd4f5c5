
# Copyright: the idempotency extension authors.
#
# IdemTest: what the TAP tests (t/*.pl) of the idempotency extension share.
# A test loads it with
#
#   use FindBin;
#   use lib "$FindBin::Bin/lib";
#   use IdemTest;
#
# which exports every sub below.  None of them runs a Test::More assertion:
# they set up servers, run SQL and wait, and return what they found, so that
# every ok/is/like (and its name) stays in the test file.  Each sub that runs
# SQL takes the node and the database first.  The files themselves are not
# TAP tests: prove runs t/*.pl only.

package IdemTest;

use strict;
use warnings FATAL => 'all';

use Exporter 'import';
use File::Basename qw(basename);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;

our @EXPORT = qw(
  $EDITION $SQL_ADMIN sql_edition skip_sql_edition install_extension drop_extension
  $CLAIM_WAITING
  new_node new_standby alter_system stop_sweeping
  sql_result sqlstate_of
  $CLAIM_COLS parse_claim claim replay_row mismatch_row body_md5 stored_row
  key_rows finish_key expiring_keys
  $CLAIM_FN catalog_queries grant_claim_per_role revoke_claim_per_role
  stale_initacl_deps
  wait_lease_over wait_past_retention wait_commits wait_next_sweep
  launcher_pid restart_launcher fail_sweeps_in log_errors
  kill_backend backend_gone);

# --- servers ---------------------------------------------------------------------

# Which edition the tests run against, from the environment:
#   IDEM_EDITION=c      (the default) the C edition, installed with make install;
#   IDEM_EDITION=plain  the SQL edition's plain installer (schema idempotency,
#                       no extension), run into each database;
#   IDEM_EDITION=pgtle  the SQL edition through pg_tle (preloaded), registered
#                       in template1 and postgres, then CREATE EXTENSION.
# IDEM_SQL_EDITION_DIR names the folder with the installers that
# scripts/sql-edition.sh built (idempotency-plain.sql, idempotency-pgtle.sql).
our $EDITION = $ENV{IDEM_EDITION} // 'c';
die "IDEM_EDITION must be c, plain or pgtle, not '$EDITION'"
  unless $EDITION =~ /^(?:c|plain|pgtle)$/;

# True when the tests run against the SQL edition (either mode).
sub sql_edition
{
	return $EDITION ne 'c';
}

# The text of the SQL edition's installer for the current mode.
sub installer_sql
{
	my $dir = $ENV{IDEM_SQL_EDITION_DIR}
	  or die "IDEM_SQL_EDITION_DIR must name the SQL edition's installers";
	return slurp_file("$dir/idempotency-$EDITION.sql");
}

# Skip the whole test file when it runs against the SQL edition, with
# $reason: what it tests is one of the allowed differences between the
# editions (sql-edition/README.md).  Call it before any plan.
sub skip_sql_edition
{
	my ($reason) = @_;
	Test::More::plan(skip_all => "SQL edition: $reason") if sql_edition();
	return;
}

# The SQL edition's installing role: no superuser, CREATEROLE, a member of
# pg_read_all_stats (it reads other sessions' activity for session-bound
# claims, as the platforms' admin roles may), and under pg_tle of
# pgtle_admin (created on first use in $node).
our $SQL_ADMIN = 'idem_admin';

# Install the extension in database $db of $node, as the edition does:
# CREATE EXTENSION idempotency (the C edition, and the SQL edition through
# pg_tle, which new_node registered in template1 and postgres), or the
# plain installer.  Options: version => a version for CREATE EXTENSION;
# user => the role that runs it (as psql -U).
#
# The SQL edition is installed as a platform installs it: by the admin
# role $SQL_ADMIN, which is no superuser (CREATEROLE, owner of the
# database, and pgtle_admin under pg_tle, as RDS's rds_superuser or
# Supabase's postgres), so that its functions run with that role's rights.
sub install_extension
{
	my ($node, $db, %opt) = @_;
	# The installer's text stays out of the server log (log_statement =
	# all in TAP nodes): its lines carry no log line prefix, so log_errors
	# could not tell them from the server's, and they name errors.
	my $user = $opt{user};
	if (sql_edition() && !defined $user)
	{
		sql_admin($node);
		$node->safe_psql($db, qq{ALTER DATABASE "$db" OWNER TO $SQL_ADMIN});
		$user = $SQL_ADMIN;
	}
	# (the admin role logs no statements: sql_admin sets that for it)
	my $sql =
	  $EDITION eq 'plain'
	  ? ($user && $user eq $SQL_ADMIN ? '' : "SET log_statement = 'none';\n")
	  . installer_sql()
	  : 'CREATE EXTENSION idempotency'
	  . (defined $opt{version} ? " VERSION '$opt{version}'" : '');
	$node->safe_psql($db, $sql, $user ? (extra_params => [ '-U', $user ]) : ());
	return;
}


sub sql_admin
{
	my ($node) = @_;
	$node->safe_psql('postgres', qq{
		DO \$\$ BEGIN
			IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$SQL_ADMIN') THEN
				CREATE ROLE $SQL_ADMIN LOGIN CREATEROLE NOSUPERUSER;
				GRANT pg_read_all_stats TO $SQL_ADMIN;
				-- the installers' text stays out of the server log
				ALTER ROLE $SQL_ADMIN SET log_statement = 'none';
			END IF;
			IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'pgtle_admin') THEN
				GRANT pgtle_admin TO $SQL_ADMIN;
			END IF;
		END \$\$;});
	return;
}

# Remove the extension from database $db of $node: DROP EXTENSION, or for
# the plain installer (which makes no extension) DROP SCHEMA ... CASCADE.
sub drop_extension
{
	my ($node, $db) = @_;
	$node->safe_psql($db,
		$EDITION eq 'plain'
		? 'DROP SCHEMA idempotency CASCADE'
		: 'DROP EXTENSION idempotency');
	return;
}

# A condition on a pg_stat_activity row: its backend sleeps in a claim's
# wait.  The C edition sleeps on its latch (wait event type Extension) until
# it is woken; the SQL edition waits for a holder's open transaction as a
# lock waits (on its row lock, or in its insert's unique check: wait event
# type Lock) and polls a claim that committed in pg_sleep (wait event
# PgSleep).
our $CLAIM_WAITING =
  $EDITION eq 'c'
  ? "wait_event_type = 'Extension'"
  : "(wait_event = 'PgSleep' OR wait_event_type = 'Lock')";

# A new node, initialized, configured and started.  Options:
#   port      => the port (it only names the Unix socket file);
#   init      => [ arguments of PostgreSQL::Test::Cluster::init ];
#   conf      => [ lines to add to postgresql.conf ];
#   preload   => 0 to leave out shared_preload_libraries = 'idempotency'
#                (which comes first in postgresql.conf otherwise);
#   extension => 1 to install the extension in database postgres
#                (install_extension).
# With the SQL edition there is no library to preload: through pg_tle,
# pg_tle is preloaded instead (whatever preload says) and the installer
# registers idempotency in template1 and postgres, so that databases
# created later from template1 can CREATE EXTENSION it.
sub new_node
{
	my ($name, %opt) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name, port => $opt{port});
	$node->init(@{ $opt{init} // [] });
	my @conf = @{ $opt{conf} // [] };
	if ($EDITION eq 'c')
	{
		unshift @conf, "shared_preload_libraries = 'idempotency'"
		  if $opt{preload} // 1;
	}
	elsif ($EDITION eq 'pgtle')
	{
		unshift @conf, "shared_preload_libraries = 'pg_tle'";
	}
	$node->append_conf('postgresql.conf', join('', map { "$_\n" } @conf))
	  if @conf;
	$node->start;
	if ($EDITION eq 'pgtle')
	{
		# the platform's superuser creates pg_tle; its admin registers the
		# extension
		$node->safe_psql($_, "CREATE EXTENSION pg_tle") for qw(template1 postgres);
		sql_admin($node);
		$node->safe_psql($_, installer_sql(), extra_params => [ '-U', $SQL_ADMIN ])
		  for qw(template1 postgres);
	}
	install_extension($node, 'postgres') if $opt{extension};
	return $node;
}

# A streaming standby of $primary, made from a base backup taken now, and
# started.  Options: port, as for new_node.
sub new_standby
{
	my ($primary, $name, %opt) = @_;
	$primary->backup('base');
	my $standby = PostgreSQL::Test::Cluster->new($name, port => $opt{port});
	$standby->init_from_backup($primary, 'base', has_streaming => 1);
	$standby->start;
	return $standby;
}

# ALTER SYSTEM SET $setting = '$value', then reload the configuration.
sub alter_system
{
	my ($node, $setting, $value) = @_;
	$node->safe_psql('postgres', "ALTER SYSTEM SET $setting = '$value'");
	$node->safe_psql('postgres', 'SELECT pg_reload_conf()');
}

# Turn the worker's sweeping off (sweep_interval = 0) and return once no
# sweep can start or be under way any more.  Dies if that does not happen in
# time.  The wait has two steps:
#  - until a new session sees the new value.  Sessions start with the
#    postmaster's settings, and the postmaster signals the launcher right
#    after it has read the file, so from then on the launcher's next look at
#    its settings sees 0 (and a launcher started later reads 0 at start);
#  - then until the launcher is in its nap between rounds (wait event
#    Extension; a round waits on BgWorkerStartup or BgWorkerShutdown, or
#    runs) and no sweeper runs.  A round under way when the signal came has
#    then ended, and the launcher looks at its settings before it could
#    start another one.  With no launcher running, only the sweeper test
#    applies.
sub stop_sweeping
{
	my ($node) = @_;
	alter_system($node, 'idempotency.sweep_interval', '0');
	$node->poll_query_until('postgres',
		"SELECT current_setting('idempotency.sweep_interval') = '0'")
	  or die "the server did not load idempotency.sweep_interval = 0";
	$node->poll_query_until('postgres',
		    "SELECT count(*) FILTER (WHERE backend_type = 'idempotency sweeper') = 0 "
		  . "AND bool_and(wait_event IS NOT DISTINCT FROM 'Extension') "
		  . "FILTER (WHERE backend_type = 'idempotency launcher') IS NOT FALSE "
		  . "FROM pg_stat_activity")
	  or die "the idempotency worker did not stop sweeping";
}

# --- SQL and its SQLSTATE --------------------------------------------------------

# Run $sql (without its final semicolon) through psql with VERBOSITY
# verbose, as $opt{user} if given.  Returns (the SQLSTATE it ends with,
# '00000' when it succeeds; stdout; stderr).
sub sql_result
{
	my ($node, $db, $sql, %opt) = @_;
	my ($ret, $out, $err) = $node->psql(
		$db, "\\set VERBOSITY verbose\n$sql;",
		$opt{user} ? (extra_params => [ '-U', $opt{user} ]) : ());
	my $state =
		($ret == 0 && $err !~ /ERROR/) ? '00000'
	  : $err =~ /ERROR:\s+([0-9A-Z]{5}):/ ? $1
	  :                                     "no SQLSTATE (ret $ret): $err";
	return ($state, $out, $err);
}

# The SQLSTATE $sql ends with ('00000' when it succeeds); as sql_result.
sub sqlstate_of
{
	return (sql_result(@_))[0];
}

# --- claims and keys -------------------------------------------------------------

# The columns of idem_claim's outcome row that parse_claim reads, the
# response body as its md5.
our $CLAIM_COLS =
  'outcome, token, attempt, status, response_code, md5(response_body::text), retry_after';

# One line of "SELECT $CLAIM_COLS" output as a hashref (outcome, token,
# attempt, status, response_code, body_md5, retry_after); SQL NULL becomes
# undef.  Dies on any other line, or with lenient => 1 returns
# { outcome => "unexpected output: '...'" } so that the caller's check fails.
sub parse_claim
{
	my ($line, %opt) = @_;
	my @f = split /\|/, $line, -1;
	if (@f != 7)
	{
		return { outcome => "unexpected output: '$line'" } if $opt{lenient};
		die "unexpected idem_claim output: '$line'";
	}
	my %r;
	@r{qw(outcome token attempt status response_code body_md5 retry_after)} =
	  map { $_ eq '' ? undef : $_ } @f;
	return \%r;
}

# idem_claim($args) in $db ($args is the SQL argument list, e.g.
# "'k', request => '{}'"), after SET ROLE $opt{role} if given.  Returns the
# outcome row as parse_claim does.
sub claim
{
	my ($node, $db, $args, %opt) = @_;
	my $set = defined $opt{role} ? "SET ROLE $opt{role};\n" : '';
	return parse_claim(
		$node->safe_psql($db,
			"${set}SELECT $CLAIM_COLS FROM idempotency.idem_claim($args)"));
}

# The claim row a replay of a stored result must be (for is_deeply).
sub replay_row
{
	my ($status, $code, $body_md5) = @_;
	return {
		outcome       => 'replay',
		token         => undef,
		attempt       => undef,
		status        => $status,
		response_code => $code,
		body_md5      => $body_md5,
		retry_after   => undef
	};
}

# The claim row of a mismatch: every column but the outcome NULL.
sub mismatch_row
{
	return {
		outcome       => 'mismatch',
		token         => undef,
		attempt       => undef,
		status        => undef,
		response_code => undef,
		body_md5      => undef,
		retry_after   => undef
	};
}

# The body_md5 a claim reports for the response $json (an SQL expression).
sub body_md5
{
	my ($node, $db, $json) = @_;
	return $node->safe_psql($db, "SELECT md5(($json)::jsonb::text)");
}

# Every column of the stored key $scope/$key as one line, response_body as
# its md5 ('' when the key is absent).
sub stored_row
{
	my ($node, $db, $scope, $key) = @_;
	return $node->safe_psql($db,
		    "SELECT status, token, attempt, encode(fingerprint, 'hex'), "
		  . "response_code, md5(response_body::text), created_at, finished_at, "
		  . "lease_until, expires_at, retention, sweep_at "
		  . "FROM idempotency.keys WHERE scope = '$scope' AND key = '$key'");
}

# Every stored key in $db (those of the SQL list $keys, e.g. "'a', 'b'", if
# given), one line each: where the tuple is (ctid), who wrote it (xmin) and
# every column, the response body as its md5.  Equal answers before and
# after a change mean the change left every row alone.
sub key_rows
{
	my ($node, $db, $keys) = @_;
	my $where = $keys ? "WHERE key IN ($keys)" : '';
	return $node->safe_psql($db,
		    "SELECT string_agg(concat_ws('|', ctid, xmin, quote_literal(scope), "
		  . "quote_literal(key), status, coalesce(token::text, 'NULL'), attempt, "
		  . "coalesce(encode(fingerprint, 'hex'), 'NULL'), "
		  . "coalesce(response_code::text, 'NULL'), "
		  . "coalesce(md5(response_body::text), 'NULL'), created_at, "
		  . "coalesce(finished_at::text, 'NULL'), coalesce(lease_until::text, 'NULL'), "
		  . "expires_at, retention, sweep_at), E'\\n' ORDER BY scope, key) "
		  . "FROM idempotency.keys $where");
}

# Claim $key (default scope) with a 1 second lease and finish it at once
# with code 200 and the response $body (an SQL jsonb expression; none when
# undef), to be kept for $retention.  Returns the claim's row (as claim).
# Claim and finish are one statement, so one transaction: nobody ever sees
# the key pending, and the worker cannot reset it under its short lease
# before the finish, however long the client takes between the two.
sub finish_key
{
	my ($node, $db, $key, $retention, $body) = @_;
	return parse_claim(
		$node->safe_psql($db,
			    "SELECT $CLAIM_COLS FROM idempotency.idem_claim('$key', "
			  . "lease => '1 second', retention => '$retention') AS c "
			  . "WHERE idempotency.idem_finish('$key', c.token, 200"
			  . (defined $body ? ", $body" : '')
			  . ") IS NOT NULL"));
}

# $n keys "$prefix-1" .. "$prefix-$n" in $db, claimed and finished (code
# 200) in one statement with a 1 second lease and retention: past
# retention a second from now.  Returns how many were finished.
sub expiring_keys
{
	my ($node, $db, $prefix, $n) = @_;
	return $node->safe_psql($db,
		    "SELECT count(*) FROM ("
		  . "SELECT idempotency.idem_finish('$prefix-' || i, c.token, 200) "
		  . "FROM generate_series(1, $n) AS i, "
		  . "LATERAL idempotency.idem_claim('$prefix-' || i, lease => '1 second', "
		  . "retention => '1 second') AS c) AS f");
}

# --- the extension's catalog ---------------------------------------------------------

# What the extension installed in a database, as a list of (what => SQL)
# pairs: each query answers one text value, ordered so that two databases'
# answers compare with eq.  A database updated to a version must answer
# each one as a fresh install of that version does: every function of the
# extension (definition, owner, privileges), claim_result's columns, the
# types, the relations (columns, options, owner, privileges), indexes,
# constraints, triggers, the stats view, the token sequence, the member
# list, the configuration tables and the initial privileges.
sub catalog_queries
{
	my $ext_oid = "(SELECT oid FROM pg_extension WHERE extname = 'idempotency')";
	my $members =
	    "SELECT classid, objid FROM pg_depend WHERE refclassid = 'pg_extension'::regclass "
	  . "AND refobjid = $ext_oid AND deptype = 'e'";
	return (
		'functions (definition, owner, privileges)' =>
		  "SELECT string_agg(pg_get_functiondef(p.oid) || 'owner ' || p.proowner::regrole "
		  . "|| ', acl ' || coalesce(p.proacl::text, 'default'), E'\\n' "
		  . "ORDER BY p.oid::regprocedure::text) FROM pg_proc p "
		  . "WHERE p.oid IN (SELECT objid FROM ($members) m "
		  . "WHERE classid = 'pg_proc'::regclass)",
		'claim_result columns' =>
		  "SELECT string_agg(concat_ws(' ', a.attnum, a.attname, "
		  . "format_type(a.atttypid, a.atttypmod), a.attcollation::regcollation), ', ' "
		  . "ORDER BY a.attnum) FROM pg_attribute a "
		  . "WHERE a.attrelid = 'idempotency.claim_result'::regclass AND a.attnum > 0 "
		  . "AND NOT a.attisdropped",
		'types (owner, privileges)' =>
		  "SELECT string_agg(concat_ws(' ', t.oid::regtype, t.typtype, t.typowner::regrole, "
		  . "coalesce(t.typacl::text, 'default')), E'\\n' ORDER BY t.oid::regtype::text) "
		  . "FROM pg_type t WHERE t.typnamespace = 'idempotency'::regnamespace",
		'relations (columns, options, owner, privileges)' =>
		  "SELECT string_agg(concat_ws(' ', c.oid::regclass, c.relkind, c.relpersistence, "
		  . "c.reloptions::text, c.relowner::regrole, coalesce(c.relacl::text, 'default'), "
		  . "(SELECT string_agg(concat_ws(' ', a.attnum, a.attname, "
		  . "format_type(a.atttypid, a.atttypmod), a.attnotnull, "
		  . "a.attcollation::regcollation, pg_get_expr(d.adbin, d.adrelid), "
		  . "coalesce(a.attacl::text, '-')), ', ' "
		  . "ORDER BY a.attnum) FROM pg_attribute a LEFT JOIN pg_attrdef d "
		  . "ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
		  . "WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)), E'\\n' "
		  . "ORDER BY c.oid::regclass::text) "
		  . "FROM pg_class c WHERE c.relnamespace = 'idempotency'::regnamespace",
		'indexes' =>
		  "SELECT string_agg(pg_get_indexdef(i.indexrelid), E'\\n' "
		  . "ORDER BY pg_get_indexdef(i.indexrelid)) "
		  . "FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
		  . "WHERE c.relnamespace = 'idempotency'::regnamespace",
		'constraints' =>
		  "SELECT string_agg(conrelid::regclass || ' ' || conname || ' ' || "
		  . "pg_get_constraintdef(oid), E'\\n' ORDER BY conrelid::regclass::text, conname) "
		  . "FROM pg_constraint "
		  . "WHERE connamespace = 'idempotency'::regnamespace",
		'triggers' =>
		  "SELECT string_agg(pg_get_triggerdef(t.oid), E'\\n' "
		  . "ORDER BY pg_get_triggerdef(t.oid)) FROM pg_trigger t "
		  . "JOIN pg_class c ON c.oid = t.tgrelid "
		  . "WHERE c.relnamespace = 'idempotency'::regnamespace",
		'the stats view' => "SELECT pg_get_viewdef('idempotency.stats'::regclass)",
		'the token sequence' =>
		  "SELECT concat_ws(' ', seqtypid::regtype, seqstart, seqincrement, seqmax, seqmin, "
		  . "seqcache, seqcycle) FROM pg_sequence "
		  . "WHERE seqrelid = 'idempotency.token_seq'::regclass",
		'extension members' =>
		  "SELECT string_agg(pg_describe_object(classid, objid, 0), E'\\n' "
		  . "ORDER BY pg_describe_object(classid, objid, 0)) "
		  . "FROM ($members) m",
		'extension configuration' =>
		  "SELECT concat_ws(' ', extconfig::regclass[], extcondition, extrelocatable, "
		  . "extnamespace::regnamespace) FROM pg_extension WHERE extname = 'idempotency'",
		'initial privileges' =>
		  "SELECT string_agg(pg_describe_object(classoid, objoid, objsubid) || ' ' || "
		  . "initprivs::text, E'\\n' "
		  . "ORDER BY pg_describe_object(classoid, objoid, objsubid)) "
		  . "FROM pg_init_privs WHERE privtype = 'e'",
	);
}

# idem_claim by its name alone, in GRANT, REVOKE and as regproc input: every
# version has one function of that name, whose arguments changed in 1.4.
our $CLAIM_FN = 'idempotency.idem_claim';

# The privileges an administrator may set on idem_claim, in $db: EXECUTE
# revoked from PUBLIC and granted to regress_lead with the grant option and
# to "Regress App", and by regress_lead to regress_worker; the three get
# USAGE on the schema.  The roles must exist.
sub grant_claim_per_role
{
	my ($node, $db) = @_;
	$node->safe_psql($db, qq{
GRANT USAGE ON SCHEMA idempotency TO regress_lead, regress_worker, "Regress App";
REVOKE EXECUTE ON FUNCTION $CLAIM_FN FROM PUBLIC;
GRANT EXECUTE ON FUNCTION $CLAIM_FN TO regress_lead WITH GRANT OPTION;
GRANT EXECUTE ON FUNCTION $CLAIM_FN TO "Regress App";
SET ROLE regress_lead;
GRANT EXECUTE ON FUNCTION $CLAIM_FN TO regress_worker;
RESET ROLE;
});
	return;
}

# Revoke in $db every privilege grant_claim_per_role granted, each by its
# grantor, so that nothing there keeps the three roles from being dropped.
sub revoke_claim_per_role
{
	my ($node, $db) = @_;
	$node->safe_psql($db, qq{
SET ROLE regress_lead;
REVOKE EXECUTE ON FUNCTION $CLAIM_FN FROM regress_worker;
RESET ROLE;
REVOKE EXECUTE ON FUNCTION $CLAIM_FN FROM regress_lead, "Regress App";
REVOKE USAGE ON SCHEMA idempotency FROM regress_lead, regress_worker, "Regress App";
});
	return;
}

# The shared dependencies on roles that initial privileges record (from
# PostgreSQL 17 on: pg_shdepend rows of deptype 'i') in $db whose object has
# no initial privileges any more, one line each ("object -> role"); '' when
# there are none.  Each such row makes DROP ROLE of its role fail.
sub stale_initacl_deps
{
	my ($node, $db) = @_;
	return $node->safe_psql($db,
		    "SELECT string_agg(pg_describe_object(s.classid, s.objid, s.objsubid) "
		  . "|| ' -> ' || s.refobjid::regrole, E'\\n' ORDER BY s.classid, s.objid, "
		  . "s.refobjid) FROM pg_shdepend s "
		  . "WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
		  . "AND s.deptype = 'i' AND NOT EXISTS (SELECT FROM pg_init_privs i "
		  . "WHERE i.classoid = s.classid AND i.objoid = s.objid "
		  . "AND i.objsubid = s.objsubid)");
}

# --- waiting ------------------------------------------------------------------------
# Each returns what poll_query_until returns: true once the condition holds,
# false when it timed out.

# Until the lease of $scope/$key has ended (or the key has none).
sub wait_lease_over
{
	my ($node, $db, $scope, $key) = @_;
	return $node->poll_query_until($db,
		    "SELECT coalesce(lease_until < clock_timestamp(), true) "
		  . "FROM idempotency.keys WHERE scope = '$scope' AND key = '$key'");
}

# Until key $key is past its retention.
sub wait_past_retention
{
	my ($node, $db, $key) = @_;
	return $node->poll_query_until($db,
		    "SELECT expires_at < clock_timestamp() FROM idempotency.keys "
		  . "WHERE key = '$key'");
}

# Until $n more transactions have committed in database $db, counted from
# now.  In a database no client uses, those are the worker's visits.
sub wait_commits
{
	my ($node, $db, $n) = @_;
	my $c = $node->safe_psql('postgres',
		"SELECT xact_commit FROM pg_stat_database WHERE datname = '$db'");
	return $node->poll_query_until('postgres',
		    "SELECT xact_commit >= $c + $n FROM pg_stat_database "
		  . "WHERE datname = '$db'");
}

# Until the stats view records a sweep of database $db later than the last
# one recorded now (the view is read in database postgres).
sub wait_next_sweep
{
	my ($node, $db) = @_;
	my $last = $node->safe_psql('postgres',
		"SELECT coalesce(last_sweep_at, '-infinity') FROM idempotency.stats "
		  . "WHERE database = '$db'");
	return $node->poll_query_until('postgres',
		    "SELECT last_sweep_at > '$last' FROM idempotency.stats "
		  . "WHERE database = '$db'");
}

# --- the worker and the server log --------------------------------------------------

# The pid of the idempotency launcher ('' when none runs).
sub launcher_pid
{
	my ($node) = @_;
	return $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher'");
}

# Terminate the launcher whose pid is $pid and wait until the postmaster has
# started a new one.  Returns (whether it was terminated, whether a new one
# runs).
sub restart_launcher
{
	my ($node, $pid) = @_;
	my $terminated =
	  $node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)") eq 't';
	my $new = $node->poll_query_until('postgres',
		    "SELECT count(*) = 1 FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher' AND pid <> $pid");
	return ($terminated, $new);
}

# Make every sweep of database $db fail: a BEFORE DELETE trigger on
# idempotency.keys, function and trigger named $name, raises $message.
sub fail_sweeps_in
{
	my ($node, $db, $name, $message) = @_;
	$node->safe_psql($db,
		    "CREATE FUNCTION public.$name() RETURNS trigger LANGUAGE plpgsql AS "
		  . "\$\$ BEGIN RAISE EXCEPTION '$message'; END \$\$;\n"
		  . "CREATE TRIGGER $name BEFORE DELETE ON idempotency.keys "
		  . "FOR EACH ROW EXECUTE FUNCTION public.$name();");
	return;
}

# The lines of $node's server log that match $opt{pattern} (default: ERROR,
# FATAL, PANIC or "failed"), from byte $opt{offset} on, joined by newlines;
# '' when there are none.  The test's own statements are left out: client
# sessions carry the test file's name (PGAPPNAME) in the log line prefix.
sub log_errors
{
	my ($node, %opt) = @_;
	my $pattern = $opt{pattern} // qr/ERROR|FATAL|PANIC|failed/;
	my $own = basename($0);
	return join "\n", grep { /$pattern/ && !/\Q$own\E/ }
	  split /\n/, slurp_file($node->logfile, $opt{offset});
}

# --- backends --------------------------------------------------------------------

# kill -9 the backend $pid of $node; wait until the postmaster has
# reinitialized, recovered and accepts connections again.
sub kill_backend
{
	my ($node, $pid, $what) = @_;
	my $offset = -s $node->logfile;
	Test::More::is(kill('KILL', $pid), 1, "$what: kill -9 sent to backend $pid");
	# "server process" up to PostgreSQL 17, "client backend" from 18
	$node->wait_for_log(
		qr/(?:server process|client backend) \(PID $pid\) was terminated by signal 9.*all server processes terminated; reinitializing.*automatic recovery in progress.*database system is ready to accept connections/s,
		$offset);
	Test::More::ok($node->poll_query_until('postgres', 'SELECT 1', '1'),
		"$what: the server accepts connections after crash recovery");
	Test::More::isnt(
		$node->safe_psql('postgres',
			"SELECT count(*) FROM pg_stat_activity WHERE pid = $pid"),
		'1', "$what: the killed backend is gone");
	return;
}

# Until the backend $pid of $node has ended: out of pg_stat_activity, and no
# lock of it left.  True once it has (false if it never does).
sub backend_gone
{
	my ($node, $pid) = @_;
	return $node->poll_query_until('postgres',
		    "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $pid) "
		  . "AND NOT EXISTS (SELECT FROM pg_locks WHERE pid = $pid)");
}

1;
