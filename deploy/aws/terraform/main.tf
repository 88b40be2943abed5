# The podmigrate testbed: VPC + one public subnet, 1 control-plane node, var.worker_count workers.

locals {
  ami_name_patterns = {
    "ubuntu-24.04" = "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*"
    "debian-12"    = "debian-12-amd64-*"
  }
  ssh_users = {
    "ubuntu-24.04" = "ubuntu"
    "debian-12"    = "admin"
  }

  availability_zone = var.availability_zone != "" ? var.availability_zone : data.aws_availability_zones.available.names[0]
  ami_id            = var.ami_id != "" ? var.ami_id : data.aws_ami.node.id
  inventory_path    = var.inventory_path != "" ? var.inventory_path : "${path.module}/../ansible/inventory.aws.ini"

  # Ports that must only ever be reachable from inside the VPC.
  kubelet_port  = 10250
  agent_port    = 7070 # podmigrate node agent (DaemonSet, host network)
  registry_port = 5000 # OCI registry for checkpoint images, on the control plane
  api_port      = 6443
}

data "aws_availability_zones" "available" {
  state = "available"
}

data "aws_ami" "node" {
  most_recent = true
  owners      = [var.ami_owners[var.os_image]]

  filter {
    name   = "name"
    values = [local.ami_name_patterns[var.os_image]]
  }

  filter {
    name   = "architecture"
    values = ["x86_64"]
  }

  filter {
    name   = "virtualization-type"
    values = ["hvm"]
  }
}

# --- network ---------------------------------------------------------------------------------

resource "aws_vpc" "main" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = { Name = "${var.name_prefix}-vpc" }
}

resource "aws_internet_gateway" "main" {
  vpc_id = aws_vpc.main.id

  tags = { Name = "${var.name_prefix}-igw" }
}

resource "aws_subnet" "public" {
  vpc_id                  = aws_vpc.main.id
  cidr_block              = var.public_subnet_cidr
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = true

  tags = { Name = "${var.name_prefix}-public" }
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.main.id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.main.id
  }

  tags = { Name = "${var.name_prefix}-public" }
}

resource "aws_route_table_association" "public" {
  subnet_id      = aws_subnet.public.id
  route_table_id = aws_route_table.public.id
}

# --- security group --------------------------------------------------------------------------
# From outside: SSH and the API server from var.ssh_allowed_cidrs only. Inside the VPC: everything
# (Cilium's VXLAN/health ports, etcd, ...). The kubelet, the node agent and the registry get explicit
# VPC-only rules as well, so the intent is visible (and tested): they are never opened to 0.0.0.0/0.

resource "aws_security_group" "nodes" {
  name        = "${var.name_prefix}-nodes"
  description = "podmigrate testbed nodes"
  vpc_id      = aws_vpc.main.id

  tags = { Name = "${var.name_prefix}-nodes" }
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  for_each = toset(var.ssh_allowed_cidrs)

  security_group_id = aws_security_group.nodes.id
  description       = "SSH from an allowed CIDR"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
}

resource "aws_vpc_security_group_ingress_rule" "api_server" {
  for_each = toset(var.ssh_allowed_cidrs)

  security_group_id = aws_security_group.nodes.id
  description       = "Kubernetes API from an allowed CIDR"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = local.api_port
  to_port           = local.api_port
}

resource "aws_vpc_security_group_ingress_rule" "vpc_all" {
  security_group_id = aws_security_group.nodes.id
  description       = "All traffic between testbed nodes"
  cidr_ipv4         = aws_vpc.main.cidr_block
  ip_protocol       = "-1"
}

resource "aws_vpc_security_group_ingress_rule" "kubelet" {
  security_group_id = aws_security_group.nodes.id
  description       = "kubelet API (checkpoint endpoint), VPC only"
  cidr_ipv4         = aws_vpc.main.cidr_block
  ip_protocol       = "tcp"
  from_port         = local.kubelet_port
  to_port           = local.kubelet_port
}

resource "aws_vpc_security_group_ingress_rule" "agent" {
  security_group_id = aws_security_group.nodes.id
  description       = "podmigrate node agent, VPC only"
  cidr_ipv4         = aws_vpc.main.cidr_block
  ip_protocol       = "tcp"
  from_port         = local.agent_port
  to_port           = local.agent_port
}

resource "aws_vpc_security_group_ingress_rule" "registry" {
  security_group_id = aws_security_group.nodes.id
  description       = "checkpoint image registry, VPC only"
  cidr_ipv4         = aws_vpc.main.cidr_block
  ip_protocol       = "tcp"
  from_port         = local.registry_port
  to_port           = local.registry_port
}

resource "aws_vpc_security_group_egress_rule" "all" {
  security_group_id = aws_security_group.nodes.id
  description       = "Outbound (packages, images)"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "-1"
}

# --- instances -------------------------------------------------------------------------------

resource "aws_key_pair" "admin" {
  key_name   = "${var.name_prefix}-admin"
  public_key = file(pathexpand(var.ssh_public_key_path))
}

resource "aws_instance" "control_plane" {
  ami                    = local.ami_id
  instance_type          = var.control_plane_instance_type
  subnet_id              = aws_subnet.public.id
  vpc_security_group_ids = [aws_security_group.nodes.id]
  key_name               = aws_key_pair.admin.key_name

  root_block_device {
    volume_size = var.root_volume_gb
    volume_type = "gp3"
    encrypted   = true
  }

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }

  tags = { Name = "${var.name_prefix}-cp", Role = "control-plane" }
}

resource "aws_instance" "worker" {
  count = var.worker_count

  ami                    = local.ami_id
  instance_type          = var.worker_instance_type
  subnet_id              = aws_subnet.public.id
  vpc_security_group_ids = [aws_security_group.nodes.id]
  key_name               = aws_key_pair.admin.key_name

  # Spot workers: AWS gives a 2-minute interruption notice (instance metadata
  # spot/instance-action), the window in which the study migrates the pod away.
  dynamic "instance_market_options" {
    for_each = var.worker_spot ? [1] : []
    content {
      market_type = "spot"
      spot_options {
        spot_instance_type             = "one-time"
        instance_interruption_behavior = "terminate"
        max_price                      = var.spot_max_price != "" ? var.spot_max_price : null
      }
    }
  }

  root_block_device {
    volume_size = var.root_volume_gb
    volume_type = "gp3"
    encrypted   = true
  }

  # IMDSv2 only; hop limit 2 so a pod (not only the host) can poll the Spot notice.
  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }

  tags = { Name = "${var.name_prefix}-worker-${count.index + 1}", Role = "worker" }
}

# --- Ansible inventory -----------------------------------------------------------------------

resource "local_file" "ansible_inventory" {
  filename        = local.inventory_path
  file_permission = "0644"
  content = templatefile("${path.module}/inventory.tftpl", {
    ssh_user      = local.ssh_users[var.os_image]
    os_image      = var.os_image
    registry_port = local.registry_port
    control_plane = {
      name       = "cp"
      public_ip  = aws_instance.control_plane.public_ip
      private_ip = aws_instance.control_plane.private_ip
    }
    workers = [
      for i, w in aws_instance.worker : {
        name       = "worker-${i + 1}"
        public_ip  = w.public_ip
        private_ip = w.private_ip
      }
    ]
  })
}
